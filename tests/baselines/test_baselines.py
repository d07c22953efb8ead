"""The baselines of ``benchmarks/switch_vs_checkpoint.py`` at toy size: every method must end in the
same full logical state as the hot switch, checked by the layout-independent fingerprint.

One spawned 4-rank job runs every method for a switch that changes everything a checkpoint can get
wrong (pipeline stages -> tensor parallelism, data-parallel replicas on both sides, zero1 shards on
both sides). The restart's load (``restart_job``, which the benchmark runs in freshly spawned
processes) runs here in the same processes after ``pair_job``: a second spawn would double the
test's time, which is mostly process start-up. The fingerprint and the piece bookkeeping the
methods rely on are checked on their own first, without processes.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dynatrain.transition.fingerprint import hash_box
from benchmarks.baselines.pair import METHODS, megatron_skip_reason
from lightning_dynatrain.transition.pieces import layout_pieces
from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
from lightning_dynatrain.vps.layout import ParallelConfig

TOY = dict(hidden=64, layers=2, heads=4, ffn_hidden=128, vocab_size=512, seq_length=64, tied_embeddings=False,
           make_vocab_size_divisible_by=32)
SRC, DST = "dp2-tp1-pp2-zero1", "dp2-tp2-pp1-zero1"


def test_fingerprint_does_not_depend_on_how_a_tensor_is_cut():
    x = torch.randn(3, 40, 50)
    shape = tuple(x.shape)
    whole = hash_box(x, (0, 0, 0), "t", shape)
    parts = [(x[:, :17], (0, 0, 0)), (x[:, 17:, :9], (0, 17, 0)), (x[:, 17:, 9:], (0, 17, 9))]
    assert sum(hash_box(v.contiguous(), lo, "t", shape) for v, lo in parts) & 0xFFFFFFFF == whole
    swapped = x.clone()
    swapped[1, 2, 3], swapped[1, 3, 2] = x[1, 3, 2], x[1, 2, 3]
    assert hash_box(swapped, (0, 0, 0), "t", shape) != whole


@pytest.mark.parametrize("layout", ["dp2-tp2-pp1", "dp1-tp2-pp2-zero1", "dp4-tp1-pp1-zero1", SRC, DST])
def test_pieces_cover_each_tensor_once(layout):
    spec = logical_spec(GPTShape(**TOY))
    pieces = layout_pieces(spec, ParallelConfig.parse(layout))
    for (tensor, kind), boxes in pieces.holders.items():
        covered = sum(box.numel for box in boxes)
        assert covered == math.prod(pieces.stored_shape[tensor]), (layout, tensor, kind)
        assert all(list(holders) == sorted(holders) for holders in boxes.values())


def test_megatron_cannot_toggle_zero1():
    zero0, zero1 = ParallelConfig.parse("dp2-tp2-pp1"), ParallelConfig.parse("dp2-tp2-pp1-zero1")
    assert megatron_skip_reason(zero0, zero1) and megatron_skip_reason(zero1, zero0)
    assert megatron_skip_reason(zero1, ParallelConfig.parse(DST)) is None


def _pair_then_restart(rank: int, world: int, cfg) -> tuple[dict, dict]:
    import torch.distributed as dist

    from benchmarks.baselines.pair import pair_job, restart_job

    out = pair_job(rank, world, cfg)
    box = [out if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    first = box[0]
    return out, restart_job(rank, world, cfg, first["restart_save"]["path"], first["fp_src"], first["step"])


@pytest.fixture(scope="module")
def pair_run(tmp_path_factory):
    from benchmarks.baselines.launch import spawn_job
    from benchmarks.baselines.pair import PairConfig
    from benchmarks.baselines.state import BenchSetup

    cfg = PairConfig(setup=BenchSetup(shape=GPTShape(**TOY), staging_budget=64 * 1024), src=SRC, dst=DST,
                     workdir=str(tmp_path_factory.mktemp("ckpt")), margin_bytes=0, probe_bytes=2**20)
    runs = spawn_job(_pair_then_restart, 4, cfg, timeout_s=240, collective_timeout_s=120)
    return [r[0] for r in runs], [r[1] for r in runs]


def test_every_method_ends_in_the_state_it_started_from(pair_run):
    ranks, restart = pair_run
    first = ranks[0]
    assert not first["errors"] and not first["skipped"], (first["errors"], first["skipped"])
    assert set(first["methods"]) == set(METHODS) - {"restart"}
    assert all(c["passed"] for c in first["checks"].values()), first["checks"]
    assert all(r["passed"] for r in first["restores"]), first["restores"]
    assert restart[0]["passed"], restart[0]["diff"]
    assert first["fingerprint_elements"] > 0 and first["step"] == 1
    assert all(m["step"] == 1 for k, m in first["methods"].items() if "step" in m)


def test_the_figures_add_up(pair_run):
    ranks, restart = pair_run
    m = ranks[0]["methods"]
    hot = m["hot_switch"]
    assert 0 < hot["engine_seconds"] < hot["seconds"] and 0 < hot["rebuild_seconds"] < hot["seconds"]
    assert hot["recv_bytes"] == ranks[0]["floor"]["recv_bytes_total"] > 0  # plan bytes = moved bytes
    assert hot["retained_bytes"] == ranks[0]["floor"]["retained_bytes_total"]
    assert 0 < hot["peak_staging_bytes"]
    assert m["allgather"]["recv_bytes"] > hot["recv_bytes"]  # the naive switch moves more
    assert all(record["warm_seconds"] > 0 for record in m.values())  # each method started from written memory
    ahead = m["hot_switch_ahead"]  # the same switch, its objects built ahead: the pause builds nothing
    assert ahead["recv_bytes"] == hot["recv_bytes"] and ahead["retained_bytes"] == hot["retained_bytes"]
    assert ahead["steps"]["model"] == ahead["steps"]["ddp_optimizer"] == 0 < ahead["steps"]["bind"], ahead["steps"]
    assert 0 < ahead["ahead_build_seconds"] <= ahead["ahead_seconds"]
    made = ranks[0]["groups_made"]  # both layouts' groups came before the methods: none made one but the
    assert made["start"] > 0 and made["end"] == made["start"] + 1, made  # ahead build's own, once per world
    for name in ("dcp", "megatron"):
        assert m[name]["checkpoint_bytes"] > 0
        assert m[name]["seconds"] >= m[name]["save_seconds"] + m[name]["load_seconds"]
    save = ranks[0]["restart_save"]
    assert save["decided_at"] <= save["saved_at"] <= restart[0]["fn_started_at"] <= restart[0]["loaded_at"]
