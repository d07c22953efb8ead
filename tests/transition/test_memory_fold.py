"""The memory a switch takes beyond the old state, a fold over its compiled program (pure, no processes)."""

from __future__ import annotations

import pytest

from lightning_dynatrain.transition.compiler import compile_switch
from lightning_dynatrain.transition.memory_fold import switch_peak_bytes
from lightning_dynatrain.transition.local_state import RegionIndex, local_numel
from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.planner import plan_rank
from lightning_dynatrain.vps.spec import Precision, StateKind

FP32 = Precision.FP32
SPEC = build_gpt_spec("tiny", GPTDims(num_layers=4, hidden=16, num_heads=4, num_query_groups=4, head_dim=4, ffn_hidden=32,
                              vocab_size=64, seq_length=8, make_vocab_size_divisible_by=8, tied_embeddings=False))


def _peak(src: str, dst: str, rank: int, **kwargs) -> int:
    a, b = ParallelConfig.parse(src), ParallelConfig.parse(dst)
    plan = plan_rank(SPEC, a, b, rank, precision=FP32)
    program = compile_switch(plan, rank_regions(SPEC, a, rank, FP32), rank_regions(SPEC, b, rank, FP32),
                             staging_budget=2**20)
    return switch_peak_bytes(program, **kwargs)


def _local_bytes(layout: str, rank: int, kinds=tuple(StateKind)) -> dict:
    index = RegionIndex(rank_regions(SPEC, ParallelConfig.parse(layout), rank, FP32))
    return {k: 4 * local_numel(r) for k, r in index.local_tensors().items() if k[1] in kinds}


@pytest.mark.parametrize("layout", ["dp2-tp2-pp1", "dp1-tp2-pp2-zero1", "dp4-tp1-pp1-zero1"])
def test_switching_to_the_same_layout_takes_nothing(layout):
    assert all(_peak(layout, layout, r) == 0 for r in range(4))
    # without keeping in place, each retained box is copied and its old tensors given back, one box
    # (a logical tensor's layers) at a time
    a = ParallelConfig.parse(layout)
    for r in range(4):
        largest_box = max(4 * t.box.numel for t in plan_rank(SPEC, a, a, r, precision=FP32).retains)
        assert 0 < _peak(layout, layout, r, keeps_in_place=False) <= largest_box


def test_a_kept_shard_is_copied_one_tensor_at_a_time():
    # dp4 -> dp2-tp2 moves nothing: without keeping, every rank copies half of each tensor and
    # drops the old one
    a, b = ParallelConfig.parse("dp4-tp1-pp1"), ParallelConfig.parse("dp2-tp2-pp1")
    for r in range(4):
        largest_box = max(4 * t.box.numel for t in plan_rank(SPEC, a, b, r, precision=FP32).retains)
        assert 0 < _peak("dp4-tp1-pp1", "dp2-tp2-pp1", r, keeps_in_place=False) <= largest_box


def test_receiving_before_the_retained_half_is_copied_holds_both():
    # dp2-tp2 -> dp4: the other half arrives before the kept half is copied, so the whole new state
    # (less tensors nothing is received into) is held beside the old half
    new = _local_bytes("dp4-tp1-pp1", 0)
    peak = _peak("dp2-tp2-pp1", "dp4-tp1-pp1", 0)
    assert 0.9 * sum(new.values()) <= peak <= sum(new.values())


def test_shared_sources_and_preallocated_destinations():
    # zero1 params are views into one flat buffer: shared, they give nothing back until the end
    src, dst = "dp4-tp1-pp1-zero1", "dp1-tp4-pp1-zero1"
    assert _peak(src, dst, 1, shared_source_kinds=[StateKind.PARAM]) > _peak(src, dst, 1)
    # a zero1 model's param buffer exists before the switch: writing it takes nothing more
    src = "dp2-tp2-pp1-zero1"
    assert _peak(src, dst, 1, preallocated_kinds=[StateKind.PARAM]) < _peak(src, dst, 1)


def test_a_kept_slice_gives_back_the_rest_of_its_old_tensor():
    # dp4 -> dp2-tp2: first-axis shards are kept as slices of the old replicas, whose other halves
    # go back before the second-axis shards are copied: the switch takes nothing on top
    for r in range(4):
        assert _peak("dp4-tp1-pp1", "dp2-tp2-pp1", r) == 0
