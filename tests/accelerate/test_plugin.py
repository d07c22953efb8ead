"""``DynaTrainPlugin`` and the Accelerator checks: every bad input is refused at once, with a typed error
that names the rule and a HINT; nothing here starts a process."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_dynatrain.accelerate import AccelerateConfigError, AcceleratorSetupError, DynaTrainPlugin
from lightning_dynatrain.accelerate.environment import check_accelerator
from lightning_dynatrain.callbacks.scheduled import ScheduleError
from lightning_dynatrain.transition.errors import StagingBudgetError
from lightning_dynatrain.megatron.gpt import GPTShape
from lightning_dynatrain.runtime.layout_checks import BatchSizeError, WorldSizeError
from lightning_dynatrain.vps.errors import DynaTrainError, LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig
from tests.errors import refused

SHAPE = GPTShape(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32,
                 make_vocab_size_divisible_by=64)
ENV = ("DYNATRAIN_LAYOUT", "DYNATRAIN_SCHEDULE", "DYNATRAIN_STAGING_BUDGET", "DYNATRAIN_SWITCH_MEMORY_LIMIT",
       "DYNATRAIN_VERIFY", "DYNATRAIN_PROMOTE_BROADCASTS", "DYNATRAIN_SEED", "DYNATRAIN_SWITCH_TIMEOUT",
       "DYNATRAIN_SWITCH_SAFETY")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_a_plugin_parses_its_settings_once() -> None:
    plugin = DynaTrainPlugin(layout="dp2-tp2-pp1", schedule="4:dp4, 2:dp1-tp2-pp2", staging_budget="64KiB",
                             switch_memory_limit="1GiB")
    assert plugin.layout == ParallelConfig.parse("dp2-tp2-pp1")
    assert [(s, str(l)) for s, l in plugin.schedule] == [(2, "dp1-tp2-pp2"), (4, "dp4-tp1-pp1")]
    assert (plugin.staging_budget, plugin.switch_memory_limit) == (64 * 1024, 2**30)
    assert (plugin.verify, plugin.promote_broadcasts, plugin.seed) == (False, True, 1234)
    assert str(plugin) == "DynaTrainPlugin(dp2-tp2-pp1, 2:dp1-tp2-pp2,4:dp4-tp1-pp1, staging 64.0 KiB)"
    assert hash(plugin) == hash(DynaTrainPlugin(layout="dp2-tp2-pp1", schedule={2: "dp1-tp2-pp2", 4: "dp4"},
                                                staging_budget=65536, switch_memory_limit=2**30))
    assert DynaTrainPlugin().layout == "auto" and DynaTrainPlugin().start_layout(4) == ParallelConfig(dp=4)
    assert (plugin.switch_timeout, plugin.switch_safety) == (None, "fast")


def test_switch_faults_settings_as_the_strategys() -> None:
    plugin = DynaTrainPlugin(layout="dp4", switch_timeout=45, switch_safety="keep_old")
    assert (plugin.switch_timeout.seconds, plugin.switch_safety) == (45.0, "keep_old")
    assert str(plugin) == "DynaTrainPlugin(dp4-tp1-pp1, no switches, staging 256.0 MiB, switch_timeout 45 s, " \
        "switch_safety keep_old)"
    assert replace(plugin, seed=7).switch_timeout == plugin.switch_timeout  # the parsed form passes back
    assert DynaTrainPlugin(switch_timeout="auto").switch_timeout is None


@pytest.mark.parametrize("layout, words", [
    ("dp2-tq2", ["'dp2-tq2'", "unknown part 'tq2'"]),
    ("dp0-tp4", ["dp=0 is not a positive integer"]),
    ("", ["layout"]),
])
def test_a_bad_layout_is_refused(layout: str, words: list[str]) -> None:
    refused(LayoutError, *words, call=lambda: DynaTrainPlugin(layout=layout))


@pytest.mark.parametrize("schedule, words", [
    ("3-dp4", ["entry '3-dp4' has no ':'", "STEP:LAYOUT"]),
    ("-2:dp4", ["step -2 is negative"]),
    ("2:dp4,2:dp2-tp2", ["step 2 appears twice"]),
    ("x:dp4", ["step 'x' is not a whole number"]),
    ("2:dp4-qq3", ["entry at step 2", "unknown part 'qq3'"]),
    ({5: "tp2-dp"}, ["entry at step 5"]),
    ("missing_schedule.yaml", ["does not exist"]),
])
def test_a_bad_schedule_is_refused(schedule, words: list[str]) -> None:
    refused(ScheduleError, *words, call=lambda: DynaTrainPlugin(schedule=schedule))


def test_layouts_that_do_not_fit_the_world_the_model_or_the_batch_are_refused_before_anything_is_built() -> None:
    plugin = DynaTrainPlugin(layout="dp2-tp2-pp1", schedule={2: "dp1-tp2-pp2", 5000: "dp1-tp1-pp4"})
    refused(ScheduleError, "step 5000", "dp1-tp1-pp4", "pp=4 must divide the 2 layers",
            call=lambda: plugin.validate(world_size=4, model=SHAPE, global_batch_size=8, micro_batch_size=1))
    refused(WorldSizeError, "needs dp*tp*pp*cp = 4 processes but the job runs 8",
            call=lambda: plugin.validate(world_size=8, model=SHAPE))
    refused(BatchSizeError, "global batch 6 is not a multiple of dp * micro_batch_size = 2 * 4",
            call=lambda: DynaTrainPlugin(layout="dp2-tp2-pp1").validate(world_size=4, model=SHAPE,
                                                                          global_batch_size=6, micro_batch_size=4))
    refused(ScheduleError, "step 3", "needs dp*tp*pp*cp = 2 processes",
            call=lambda: DynaTrainPlugin(layout="dp4", schedule="3:dp2").validate(world_size=4))
    fits = DynaTrainPlugin(layout="dp2-tp2-pp1", schedule={2: "dp1-tp2-pp2", 4: "dp2-tp1-pp2-zero1"})
    assert fits.validate(world_size=4, model=SHAPE, global_batch_size=8, micro_batch_size=1) == \
        ParallelConfig.parse("dp2-tp2-pp1")


@pytest.mark.parametrize("field, value, kind, words", [
    ("staging_budget", "lots", StagingBudgetError, ["'lots'"]),
    ("staging_budget", 0, StagingBudgetError, ["positive"]),
    ("switch_memory_limit", "4 parsecs", StagingBudgetError, ["'4 parsecs'"]),
    ("verify", "maybe", AccelerateConfigError, ["verify='maybe'", "DYNATRAIN_VERIFY"]),
    ("seed", "1.5", AccelerateConfigError, ["seed='1.5'", "DYNATRAIN_SEED"]),
    ("switch_timeout", "soon", DynaTrainError, ["switch_timeout='soon'", "seconds"]),
    ("switch_timeout", -5, DynaTrainError, ["switch_timeout"]),
    ("switch_safety", "careful", DynaTrainError, ["switch_safety='careful'", "keep_old"]),
    ("on_refused", "ignore", AccelerateConfigError, ["on_refused='ignore' is not one of continue, raise",
                                                     "DYNATRAIN_ON_REFUSED=continue"]),
])
def test_bad_budgets_and_flags_are_refused(field: str, value, kind: type[Exception], words: list[str]) -> None:
    refused(kind, *words, call=lambda: DynaTrainPlugin(**{field: value}))


def test_environment_variables_are_the_defaults_and_arguments_win(monkeypatch) -> None:
    monkeypatch.setenv("DYNATRAIN_LAYOUT", "dp1-tp2-pp2")
    monkeypatch.setenv("DYNATRAIN_SCHEDULE", "3:dp4")
    monkeypatch.setenv("DYNATRAIN_STAGING_BUDGET", "1MiB")
    monkeypatch.setenv("DYNATRAIN_VERIFY", "true")
    monkeypatch.setenv("DYNATRAIN_SWITCH_TIMEOUT", "120")
    monkeypatch.setenv("DYNATRAIN_SWITCH_SAFETY", "keep_old")
    from_env = DynaTrainPlugin()
    assert (str(from_env.layout), str(from_env.schedule_map[3]), from_env.staging_budget, from_env.verify) == (
        "dp1-tp2-pp2", "dp4-tp1-pp1", 2**20, True)
    assert (from_env.switch_timeout.seconds, from_env.switch_safety) == (120.0, "keep_old")
    assert from_env.schedule_ahead is True and "built on demand" not in str(from_env)
    monkeypatch.setenv("DYNATRAIN_SCHEDULE_AHEAD", "false")
    assert DynaTrainPlugin().schedule_ahead is False and str(DynaTrainPlugin()).endswith(", switches built on demand)")
    assert DynaTrainPlugin(schedule_ahead=True).schedule_ahead is True  # an argument wins
    assert DynaTrainPlugin().on_refused == "continue" and "refused switches raise" not in str(DynaTrainPlugin())
    monkeypatch.setenv("DYNATRAIN_ON_REFUSED", "Raise")
    assert DynaTrainPlugin().on_refused == "raise" and "refused switches raise" in str(DynaTrainPlugin())
    assert str(DynaTrainPlugin(layout="dp4", schedule={}).layout) == "dp4-tp1-pp1"
    monkeypatch.setenv("DYNATRAIN_LAYOUT", "dp2-xx2")
    refused(LayoutError, "unknown part 'xx2'", call=DynaTrainPlugin)


def test_a_yaml_block_in_the_style_of_accelerates_config(tmp_path) -> None:
    path = tmp_path / "dynatrain.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n"
                    "dynatrain_config:\n  dynatrain_layout: dp2-tp2-pp1\n"
                    "  dynatrain_schedule: {2: dp1-tp2-pp2, 4: dp2-tp1-pp2-zero1}\n"
                    "  dynatrain_staging_budget: 64KiB\n  dynatrain_verify: true\n")
    plugin = DynaTrainPlugin.from_yaml(path)
    assert str(plugin) == "DynaTrainPlugin(dp2-tp2-pp1, 2:dp1-tp2-pp2,4:dp2-tp1-pp2-zero1, staging 64.0 KiB)"
    assert plugin.verify
    assert str(DynaTrainPlugin.from_yaml(path, layout="dp4").layout) == "dp4-tp1-pp1"

    path.write_text("dynatrain_config:\n  dynatrain_layout: dp4\n  layout_typo: dp2\n")
    refused(AccelerateConfigError, "unknown keys ['layout_typo']", "dynatrain_layout",
            call=lambda: DynaTrainPlugin.from_yaml(path))
    path.write_text("distributed_type: MULTI_CPU\n")
    refused(AccelerateConfigError, "no `dynatrain_config:` mapping", call=lambda: DynaTrainPlugin.from_yaml(path))
    path.write_text("dynatrain_config:\n  dynatrain_schedule: {2: dp9-tp}\n")
    refused(ScheduleError, "entry at step 2", call=lambda: DynaTrainPlugin.from_yaml(path))
    refused(AccelerateConfigError, "cannot read", call=lambda: DynaTrainPlugin.from_yaml(tmp_path / "absent.yaml"))


def test_accelerator_settings_the_megatron_step_cannot_honour_are_refused() -> None:
    import torch

    good = dict(distributed_type="DistributedType.MULTI_CPU", gradient_accumulation_steps=1, mixed_precision="no",
                initialized=True)
    assert check_accelerator(**good) == torch.float32
    assert check_accelerator(**{**good, "mixed_precision": "bf16"}) == torch.bfloat16
    refused(AcceleratorSetupError, "not initialised", "--multi_gpu", "Accelerator(cpu=True)",
            call=lambda: check_accelerator(**{**good, "distributed_type": "DistributedType.NO", "initialized": False}))
    refused(AcceleratorSetupError, "DEEPSPEED", call=lambda: check_accelerator(**{**good, "distributed_type": "DEEPSPEED"}))
    refused(AcceleratorSetupError, "gradient_accumulation_steps=4", "micro_batch_size",
            call=lambda: check_accelerator(**{**good, "gradient_accumulation_steps": 4}))
    refused(AcceleratorSetupError, "mixed_precision='fp16'",
            call=lambda: check_accelerator(**{**good, "mixed_precision": "fp16"}))
