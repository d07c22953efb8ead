"""Which destination tensors a switch can keep in place: whole, or as one contiguous slice of the source."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from lightning_dynatrain.transition.adoption import contiguous_run, slice_keys
from lightning_dynatrain.transition.local_state import RegionIndex
from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.planner import plan_rank
from lightning_dynatrain.vps.spec import StateKind

DIMS = GPTDims(num_layers=2, hidden=8, num_heads=4, num_query_groups=4, head_dim=2, ffn_hidden=8, vocab_size=13,
               seq_length=8, make_vocab_size_divisible_by=4, add_bias_linear=True)


@st.composite
def _box_in_box(draw):
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    lo = [draw(st.integers(0, n - 1)) for n in shape]
    hi = [draw(st.integers(a + 1, n)) for a, n in zip(lo, shape)]
    origin = draw(st.lists(st.integers(-3, 3), min_size=len(shape), max_size=len(shape)))
    return origin, shape, lo, hi


@settings(max_examples=300, deadline=None)
@given(_box_in_box())
def test_contiguous_run_agrees_with_the_elements_of_a_real_tensor(case):
    origin, shape, lo, hi = case
    inner_origin = [o + a for o, a in zip(origin, lo)]
    inner_shape = [b - a for a, b in zip(lo, hi)]
    indices = torch.arange(torch.Size(shape).numel()).view(shape)[tuple(slice(a, b) for a, b in zip(lo, hi))]
    flat = indices.reshape(-1)
    expected = None
    if torch.equal(flat, torch.arange(int(flat[0]), int(flat[0]) + flat.numel())):
        expected = (int(flat[0]), int(flat[-1]) + 1)
    assert contiguous_run(origin, shape, inner_origin, inner_shape) == expected


def test_a_box_outside_the_source_tensor_is_no_run():
    assert contiguous_run((0, 0), (4, 4), (3, 0), (2, 4)) is None
    assert contiguous_run((2, 0), (4, 4), (1, 0), (1, 4)) is None


def test_a_data_to_tensor_parallel_switch_keeps_the_first_axis_shards_as_slices():
    """``dp2 -> tp2``: each rank keeps its tensor-parallel shard of its full replica; the shards cut
    along the first axis (column-parallel weights, the vocabulary) are runs, the others are not."""
    spec = build_gpt_spec("tiny", DIMS)
    src, dst = ParallelConfig.parse("dp2"), ParallelConfig.parse("tp2")
    for rank in range(2):
        plan = plan_rank(spec, src, dst, rank)
        a, b = rank_regions(spec, src, rank), rank_regions(spec, dst, rank)
        runs = slice_keys(plan.retains, RegionIndex(a), RegionIndex(b))
        assert runs, "column-parallel shards are kept as slices"
        for (tensor, kind, stack), (start, stop) in runs.items():
            (whole,), (part,) = a[(tensor, kind)], b[(tensor, kind)]
            assert whole.view_shape[1:] == part.view_shape[1:] and part.view_shape[0] < whole.view_shape[0]
            row = torch.Size(whole.view_shape[1:]).numel()
            n = len(whole.origin) - len(whole.view_shape)
            assert start == (part.origin[n] - whole.origin[n]) * row and stop - start == torch.Size(part.view_shape).numel()
        sliced = {k[0] for k in runs}
        row_parallel = [t.name for t in spec.tensors if "linear_fc2.weight" in t.name or "linear_proj.weight" in t.name]
        assert row_parallel and not sliced & set(row_parallel), "a shard along the second axis is not a run"
        assert all(k[1] in (StateKind.PARAM, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ) for k in runs)


def test_turning_zero1_on_keeps_each_ranks_share_of_whole_moments_as_slices():
    """``dp2 -> dp2-zero1``: params stay whole (``adoptable_keys``); each rank's zero1 shard of an Adam
    moment is the flat range of its whole old moment tensor that the shard covers."""
    spec = build_gpt_spec("tiny", DIMS)
    src, dst = ParallelConfig.parse("dp2"), ParallelConfig.parse("dp2-zero1")
    for rank in range(2):
        plan = plan_rank(spec, src, dst, rank)
        b = RegionIndex(rank_regions(spec, dst, rank))
        runs = slice_keys(plan.retains, RegionIndex(rank_regions(spec, src, rank)), b)
        shards = {k: r for k, r in b.local_tensors().items() if r.flat is not None}
        assert shards and set(runs) == set(shards)
        assert {k[1] for k in runs} == {StateKind.EXP_AVG, StateKind.EXP_AVG_SQ}
        for key, (start, stop) in runs.items():
            assert (start, stop) == shards[key].flat, key
