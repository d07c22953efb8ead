"""The strategy's plain parts without processes: registry, construction errors, batch and vocab rules,
the LR schedule, switch reports and their logging protocol."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from lightning_dynatrain.transition.report import PrimitiveStats, SwitchReport
from lightning_dynatrain.transition.errors import StagingBudgetError
from lightning_dynatrain.strategy import DynaTrainStrategy, warmup_cosine_lr
from lightning_dynatrain.runtime.layout_checks import BatchSizeError, WorldSizeError, num_microbatches, validate_target, vocab_divisor_for
from lightning_dynatrain.runtime.reconfig_report import ReconfigReport
from lightning_dynatrain.strategy.switch_requests import log_switch
from lightning_dynatrain.vps.errors import LayoutError


def test_import_registers_the_strategy_lazily() -> None:
    """``import lightning_dynatrain`` loads neither Lightning nor megatron; "dynatrain" is registered once
    Lightning is imported, in either order."""
    code = ("import sys, lightning_dynatrain\n"
            "print(any(m.startswith(('lightning.', 'megatron')) for m in sys.modules))\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "print(StrategyRegistry['dynatrain']['strategy'].__name__)\n"
            "print(any(m.startswith('megatron') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "DynaTrainStrategy", "False"], out.stderr[-2000:]


def test_construction_checks_layout_and_budget() -> None:
    strategy = DynaTrainStrategy("tp2-dp2", staging_budget="1MiB")
    assert repr(strategy) == "DynaTrainStrategy(layout='dp2-tp2-pp1', staging_budget=1048576)"
    assert strategy.is_distributed is True and strategy.num_nodes == 1  # self.log(sync_dist=True) reduces
    with pytest.raises(RuntimeError, match="set in setup_environment"):
        strategy.layout
    with pytest.raises(RuntimeError, match="built in DynaTrainStrategy.setup"):
        strategy.megatron
    with pytest.raises(LayoutError, match="unknown part 'xp2'"):
        DynaTrainStrategy("dp2-xp2")
    with pytest.raises(StagingBudgetError):
        DynaTrainStrategy("dp2", staging_budget="lots")
    with pytest.raises(StagingBudgetError):
        DynaTrainStrategy("dp2", switch_memory_limit="lots")
    assert DynaTrainStrategy("dp2", switch_memory_limit="4GiB").settings.switch_memory_limit == 4 * 2**30
    assert DynaTrainStrategy("dp2").settings.switch_memory_limit is None
    assert repr(DynaTrainStrategy()) == "DynaTrainStrategy(layout='auto', staging_budget=268435456)"


def test_validate_target_rules() -> None:
    from lightning_dynatrain.megatron.gpt import GPTShape

    shape = GPTShape(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=16)
    target = validate_target("dp2-tp2", world_size=4, model=shape, global_batch_size=8, micro_batch_size=2)
    assert str(target) == "dp2-tp2-pp1"
    with pytest.raises(WorldSizeError, match="Elastic Device Manager"):
        validate_target("dp2", world_size=4)
    with pytest.raises(LayoutError, match="tp=8 must divide the 4 attention heads"):
        validate_target("tp8", world_size=8, model=shape)
    with pytest.raises(LayoutError, match="context parallelism"):
        validate_target("dp2-cp2", world_size=4, model=shape)
    with pytest.raises(BatchSizeError, match="global batch 6 is not a multiple of dp \\* micro_batch_size = 4 \\* 1"):
        validate_target("dp4", world_size=4, global_batch_size=6, micro_batch_size=1)


def test_microbatches_and_vocab_padding() -> None:
    from lightning_dynatrain.megatron.gpt import GPTShape, padded_vocab_size

    assert num_microbatches(16, 2, 2) == 4 and num_microbatches(16, 4, 4) == 1
    with pytest.raises(BatchSizeError):
        num_microbatches(16, 3, 1)
    for vocab, tps in ((256, [1, 2, 4]), (256, [1, 2]), (250, [1, 2, 4, 8]), (100, [1, 3])):
        divisor = vocab_divisor_for(vocab, tps)
        shape = GPTShape(hidden=8, layers=1, heads=1, ffn_hidden=8, vocab_size=vocab, seq_length=4,
                         make_vocab_size_divisible_by=divisor)
        assert len({padded_vocab_size(shape, tp) for tp in tps}) == 1, (vocab, tps)
    assert vocab_divisor_for(256, [1, 2]) == 128


def test_warmup_cosine() -> None:
    lrs = [warmup_cosine_lr(s, peak=1.0, warmup_steps=4, max_steps=20, min_ratio=0.1) for s in range(25)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[20] == pytest.approx(0.1) == lrs[24]
    assert warmup_cosine_lr(99, peak=2.0, warmup_steps=0, max_steps=None) == 2.0


def _engine_report() -> SwitchReport:
    return SwitchReport(rank=0, src="dp2-tp1-pp1", dst="dp1-tp2-pp1", plan_s=0.01, allocate_s=0.0, copy_s=0.02,
                        pack_s=0.0, transfer_s=0.1, unpack_s=0.0, free_s=0.0, total_seconds=0.2,
                        sent_intra_node_bytes=3000, sent_inter_node_bytes=1000, recv_intra_node_bytes=0,
                        recv_inter_node_bytes=0, retained_bytes=500, stages=2, peak_staging_bytes=4096,
                        staging_budget_bytes=1 << 20, p2p=PrimitiveStats(), p2p_direct=PrimitiveStats(),
                        broadcast=PrimitiveStats(), local_copy=PrimitiveStats(), in_place=PrimitiveStats())


def test_a_rank_result_becomes_the_jobs_report_and_logs_its_figures(capsys) -> None:
    from lightning_dynatrain.megatron.hot_switch import HotSwitchResult
    from lightning_dynatrain.devices.memory_policy import MemoryFigures

    result = HotSwitchResult(state=None, report=_engine_report(), seconds=0.25, memory=MemoryFigures(),
                             phases={"plan": 0.002, "groups": 0.01, "model": 0.02, "ddp_optimizer": 0.02,
                                     "engine": 0.2})
    report = ReconfigReport.gather(result, step=200)  # no torch.distributed here: the rank's figures
    assert (report.src, report.dst) == ("dp2-tp1-pp1", "dp1-tp2-pp1")
    assert (report.moved_bytes, report.inter_node_bytes, report.retained_bytes, report.peak_staging_bytes) == \
        (4000, 1000, 500, 4096)
    assert report.phase_seconds["rebuild"] == pytest.approx(0.05) and report.phase_seconds["agree"] == 0.01
    assert report.metrics()["dynatrain/switch_seconds"] == pytest.approx(0.25)
    assert report.metrics()["dynatrain/switch_transfer_seconds"] == 0.1
    assert set(report.metrics()) >= {"dynatrain/moved_bytes", "dynatrain/retained_bytes", "dynatrain/peak_staging_bytes",
                                     "dynatrain/broadcast_bytes", "dynatrain/inter_node_bytes"}
    assert json.loads(json.dumps(report.to_json()))["phase_seconds"]["rebuild"] == pytest.approx(0.05)

    logged = []
    trainer = SimpleNamespace(loggers=[SimpleNamespace(log_metrics=lambda m, step: logged.append((step, m)))])
    log_switch(trainer, report, is_global_zero=True)
    line = capsys.readouterr().out.strip()
    assert line == ("[dynatrain] step 200: dp2-tp1-pp1 -> dp1-tp2-pp1 in 0.250 s, moved 3.9 KiB (inter-node 1000 B, "
                    "broadcast 0 B), retained 500 B (in place 0 B), peak staging 4.0 KiB")
    assert logged[0][0] == 200 and logged[0][1]["dynatrain/moved_bytes"] == 4000
    log_switch(trainer, ReconfigReport(step=3, src="dp4-tp1-pp1", dst="dp4-tp1-pp1"), is_global_zero=False)
    assert capsys.readouterr().out == "" and len(logged) == 1  # no-op: no metrics; rank != 0: no line


def test_a_switch_built_ahead_reports_its_build_and_the_steps_beside_it(capsys) -> None:
    from lightning_dynatrain.megatron.hot_switch import HotSwitchResult
    from lightning_dynatrain.devices.memory_policy import MemoryFigures
    from lightning_dynatrain.runtime.step_clock import OverlapClock

    clock = OverlapClock(steady_window=3)
    for seconds in (1.0, 1.0, 2.0, 1.0):  # the window keeps the last 3 steady steps: median 1.0
        clock.add(seconds, overlapped=False)
    clock.add(1.5, overlapped=True)
    clock.add(1.1, overlapped=True)
    slowdown = clock.slowdown()
    assert slowdown == pytest.approx(0.3) and clock.slowdown() is None  # forgotten once read
    result = HotSwitchResult(state=None, report=_engine_report(), seconds=0.25, memory=MemoryFigures(),
                             phases={"plan": 0.002, "groups": 0.001, "bind": 0.01, "engine": 0.2},
                             ahead_build_seconds=1.25)
    report = ReconfigReport.gather(result, step=7, overlap_slowdown=slowdown)
    assert report.phase_seconds["rebuild"] == pytest.approx(0.011)
    assert (report.ahead_build_seconds, report.overlap_slowdown) == (1.25, pytest.approx(0.3))
    assert report.metrics()["dynatrain/switch_ahead_build_seconds"] == 1.25
    assert str(report).endswith("; built ahead in 1.25 s in the background, steps beside it +30%")
    on_demand = ReconfigReport.gather(HotSwitchResult(state=None, report=_engine_report(), seconds=0.25,
                                                      memory=MemoryFigures(), phases={}), step=8)
    assert on_demand.ahead_build_seconds is None and on_demand.overlap_slowdown is None
    assert "dynatrain/switch_ahead_build_seconds" not in on_demand.metrics() and "ahead" not in str(on_demand)


@pytest.mark.parametrize("precision, dtype", [("32-true", "float32"), ("bf16-mixed", "bfloat16"),
                                              ("bf16", "bfloat16"), (32, "float32")])
def test_trainer_precision_becomes_megatrons_mixed_precision(precision, dtype) -> None:
    """Lightning's autocast plugin is replaced by one that leaves casting to megatron."""
    import torch
    from lightning.pytorch import Trainer

    from lightning_dynatrain.strategy.precision import MegatronPrecision

    strategy = DynaTrainStrategy("dp1")
    Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, logger=False)
    plugin = strategy.precision_plugin
    assert isinstance(plugin, MegatronPrecision) and plugin.params_dtype == getattr(torch, dtype)
    with plugin.forward_context():
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("precision, words", [("16-true", "pure fp16"), ("bf16-true", "pure bf16"),
                                              ("64-true", "fp64")])
def test_precisions_megatron_does_not_run_are_refused(precision, words) -> None:
    from lightning.pytorch import Trainer

    from lightning_dynatrain.strategy.precision import PrecisionError

    with pytest.raises(PrecisionError, match=words) as err:
        Trainer(accelerator="cpu", devices=1, strategy=DynaTrainStrategy("dp1"), precision=precision, logger=False)
    assert 'precision="bf16-mixed"' in str(err.value)


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available:UserWarning")
def test_fp16_mixed_is_refused_with_the_reason() -> None:
    """On a GPU Lightning hands over "16-mixed" (on CPU it makes it "bf16-mixed" itself, with a warning)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_dynatrain.strategy.precision import PrecisionError, megatron_precision

    with pytest.raises(PrecisionError, match="loss scaler"):
        megatron_precision(MixedPrecision("16-mixed", "cuda"))


def test_the_recipe_and_the_trainer_cannot_disagree_silently() -> None:
    import torch

    from lightning_dynatrain.strategy.precision import MegatronPrecision, PrecisionError, resolve_params_dtype

    fp32, bf16 = MegatronPrecision("32-true"), MegatronPrecision("bf16-mixed")
    assert resolve_params_dtype(None, bf16) == torch.bfloat16
    assert resolve_params_dtype(None, fp32) == torch.float32
    assert resolve_params_dtype(torch.bfloat16, bf16) == torch.bfloat16
    # the recipe's bf16 refines Lightning's default, as before Trainer(precision=...) was mapped
    assert resolve_params_dtype(torch.bfloat16, fp32) == torch.bfloat16
    with pytest.raises(PrecisionError, match="disagree"):
        resolve_params_dtype(torch.float32, bf16)
    with pytest.raises(PrecisionError, match="not supported"):
        resolve_params_dtype(torch.float16, fp32)
