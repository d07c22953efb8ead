"""Plans after a death (pure): the survivors source every box from a surviving holder, or the plan
names what went with the dead (``StateLostError``), over random models, layouts and dead ranks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings, strategies as st

from lightning_dynatrain.vps.errors import PlanError, StateLostError
from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.lost_state import lost_bytes, lost_state
from lightning_dynatrain.vps.members import Members
from lightning_dynatrain.vps.planner import plan_all
from lightning_dynatrain.vps.spec import VOCAB, Precision
from lightning_dynatrain.vps.topology import Topology
from tests.vps.simulator import held_elements, minimum_moved, only_held_by, simulate
from tests.vps.strategies import layouts, small_specs

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
SPEC = build_gpt_spec("tiny", GPTDims(num_layers=2, hidden=8, num_heads=2, ffn_hidden=8, vocab_size=16))


@st.composite
def deaths(draw, *, moe=None):
    """A spec, a layout of 2-8 ranks, some of them dead (not all), a layout of the survivors."""
    spec = draw(small_specs(moe=moe))
    src = draw(layouts(spec, world_size=draw(st.sampled_from([2, 3, 4, 6, 8]))))
    dead = frozenset(draw(st.sets(st.integers(0, src.world_size - 1), min_size=1, max_size=src.world_size - 1)))
    dst = draw(layouts(spec, world_size=src.world_size - len(dead)))
    return spec, src, dst, dead, draw(st.sampled_from(list(Precision)))


def assert_lost_as_brute_force(spec, layout, dead, precision, lost) -> None:
    """``lost`` is what losing ``dead`` takes, by brute force over each rank's regions: its boxes
    cover every element that only dead ranks hold exactly once and nothing else, and each box's
    ``holders`` are the ranks holding all of it (no other rank holds any of it)."""
    held = held_elements(spec, layout, precision)
    covered = {key: np.zeros(mask.shape[1:], dtype=np.int64) for key, mask in held.items()}
    for b in lost:
        where = b.box.relative_to((0,) * b.box.ndim)
        holders = held[(b.tensor, b.kind)][(slice(None), *where)]
        assert [r for r in range(layout.world_size) if holders[r].any()] == list(b.holders), str(b)
        assert all(holders[r].all() for r in b.holders), f"{b}: a holder holds only part of it"
        covered[(b.tensor, b.kind)][where] += 1
    for key, only_dead in only_held_by(held, dead).items():
        assert (covered[key] == only_dead).all(), f"{key}: {int(only_dead.sum())} elements only the dead held, " \
            f"{int(covered[key].sum())} in the lost boxes"


def _in_vocab_padding(spec, lost) -> bool:
    axis = spec.tensor(lost.tensor).axis_of(VOCAB)
    return axis is not None and lost.box.lo[axis] >= spec.vocab_size


@settings(max_examples=150, **SETTINGS)
@given(deaths())
def test_the_survivors_plan_is_exact_and_minimal_or_names_what_went(case):
    """Either every destination element comes from a surviving holder, exactly once, with no more
    moved than the survivors must, or the plan fails listing exactly the boxes only the dead held."""
    spec, src, dst, dead, precision = case
    members = Members.after_loss(src.world_size, dead=dead, dst_world=dst.world_size)
    lost = lost_state(spec, src, dead, precision)
    assert_lost_as_brute_force(spec, src, dead, precision, lost)
    try:
        plans = plan_all(spec, src, dst, members=members, precision=precision,
                         topology=Topology.uniform(members.size, 2))
    except StateLostError as err:
        event("state lost")
        assert lost and err.lost == lost and err.ranks == tuple(sorted(dead))
        assert f"{len(lost)} boxes" in str(err) and str(lost[0]) in str(err)
        return
    event("survivors hold it all" if not lost else "only padding lost")
    # what the dead alone held and the plan did not need: rows past the vocabulary, never read
    assert all(_in_vocab_padding(spec, b) for b in lost), lost
    assert all(p.peer != r for r, plan in plans.items() for p in plan.recvs)  # nothing read from oneself
    result = simulate(spec, src, dst, plans, precision, members=members)
    assert result.moved_elements == minimum_moved(spec, src, dst, precision, members=members)


@settings(max_examples=100, **SETTINGS)
@given(deaths(moe=False))
def test_a_dense_layout_with_data_parallel_replicas_loses_nothing_of_one_dead_rank(case):
    """dp >= 2 without zero1: every box has a replica on another rank of its data-parallel group;
    the whole group of one tp/pp cell dead takes that cell's boxes."""
    spec, src, _, _, precision = case
    src = src.replace(zero=0)
    assume(src.dp >= 2)
    for rank in range(src.world_size):
        assert lost_state(spec, src, {rank}, precision) == ()
    cell = [r for r in range(src.world_size) if src.dense_coord(r).tp == 0 and src.dense_coord(r).pp == 0]
    lost = lost_state(spec, src, set(cell), precision)
    assert lost
    assert_lost_as_brute_force(spec, src, set(cell), precision, lost)


def test_zero1_loses_the_optimizer_shard_of_a_dead_rank_but_no_parameter():
    """Known sizes for the tiny GPT (2 layers of 8 x 8 matrices: linear_proj 128, linear_qkv 384,
    linear_fc1 256 and linear_fc2 128 elements over both; a 256-row padded embedding and output
    layer of 2048 each; bf16 params, fp32 main params and Adam moments)."""
    lost = lost_state(SPEC, ParallelConfig.parse("dp2-tp2-zero1"), {1}, Precision.BF16)
    assert {b.kind.value for b in lost} == {"main_param", "exp_avg", "exp_avg_sq"}
    assert all(b.holders == (1,) for b in lost)
    # rank 1 (dp0, tp1) alone holds a quarter of each decoder matrix's optimizer state and half the
    # output layer's (zero1 puts it whole in dp shard 0); the layernorms' state has its tp0 replica
    assert lost_bytes(SPEC, lost, Precision.BF16) == 3 * 4 * ((128 + 384 + 256 + 128) // 4 + 2048 // 2)
    assert_lost_as_brute_force(SPEC, ParallelConfig.parse("dp2-tp2-zero1"), {1}, Precision.BF16, lost)
    assert lost_state(SPEC, ParallelConfig.parse("dp2-tp2"), {1}, Precision.BF16) == ()
    # both tp1 replicas: the tp1 half of every tp-split tensor, params and optimizer state
    both = lost_state(SPEC, ParallelConfig.parse("dp2-tp2"), {1, 3}, Precision.BF16)
    assert all(b.holders == (1, 3) for b in both)
    assert lost_bytes(SPEC, both, Precision.BF16) == (2 + 3 * 4) * ((128 + 384 + 256 + 128) // 2 + 2 * 2048 // 2)


def test_after_loss_numbers_the_survivors_in_rank_order_and_refuses_what_cannot_be():
    members = Members.after_loss(4, dead={0, 2}, dst_world=2)
    assert (members.src, members.dst, members.size, members.lost) == ((None, 0, None, 1), (0, 1), 2, (0, 2))
    assert members.src_rank(1) == 3 and members.holders == frozenset({0, 1})
    with pytest.raises(PlanError, match="2 survivors cannot hold a destination of 3"):
        Members.after_loss(4, dead={0, 2}, dst_world=3)
    with pytest.raises(PlanError, match="dead ranks"):
        Members.after_loss(4, dead=set(), dst_world=4)
    with pytest.raises(PlanError, match="destination rank without a process"):
        Members((0, 1), (0, None), 2)
