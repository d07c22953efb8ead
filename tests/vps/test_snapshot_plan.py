"""The snapshot plan (pure): after losing any one failure domain, every box of the state is held by a
survivor or by a snapshot kept outside that domain; nothing with a replica elsewhere is copied; and
going back to the snapshot (the survivors' own copies through the recovery switch, the dead's boxes
from their keepers) rebuilds every element of any layout of the survivors exactly once."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.errors import StateLostError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.lost_state import lost_state
from lightning_dynatrain.vps.planner import plan_all
from lightning_dynatrain.vps.recovery_source import SnapshotHolding, snapshot_source
from lightning_dynatrain.vps.snapshot_plan import failure_domains, fill_plan, snapshot_plan
from lightning_dynatrain.vps.spec import Precision
from lightning_dynatrain.vps.topology import Topology
from tests.vps.simulator import simulate
from tests.vps.strategies import layouts, small_specs

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
SPEC = build_gpt_spec("tiny", GPTDims(num_layers=2, hidden=8, num_heads=2, ffn_hidden=8, vocab_size=16))


@st.composite
def cases(draw):
    spec = draw(small_specs())
    layout = draw(layouts(spec, world_size=draw(st.sampled_from([2, 3, 4, 6, 8]))))
    world = layout.world_size
    nodes = draw(st.lists(st.integers(0, 3), min_size=world, max_size=world))  # any rank -> node map
    return spec, layout, Topology(tuple(nodes)), draw(st.sampled_from(list(Precision)))


@settings(max_examples=120, **SETTINGS)
@given(cases())
def test_losing_any_one_domain_loses_nothing_a_snapshot_does_not_hold(case):
    spec, layout, topology, precision = case
    plan = snapshot_plan(spec, layout, topology, precision)
    assert sorted(r for d in plan.domains for r in d) == list(range(layout.world_size))
    for copy in plan.copies:
        assert plan.domain_of(copy.keeper) != plan.domain_of(copy.sender)
        # only what losing the sender's domain would take is copied
        dead = plan.domains[plan.domain_of(copy.sender)]
        assert any((b.tensor, b.kind, b.box) == (copy.tensor, copy.kind, copy.box)
                   for b in lost_state(spec, layout, dead, precision))
    for domain in range(len(plan.domains)):
        assert plan.uncovered(spec, domain) == ()
    assert sum(plan.sent_bytes(r) for r in range(layout.world_size)) == \
        sum(plan.held_bytes(r) for r in range(layout.world_size))


def test_replicas_in_other_domains_need_no_snapshot_and_zero1_shards_do():
    one_node, two_nodes = Topology.uniform(4, 4), Topology.uniform(4, 2)
    assert failure_domains(one_node, 4) == ((0,), (1,), (2,), (3,))  # one node: each process its own
    assert failure_domains(two_nodes, 4) == ((0, 1), (2, 3))
    assert snapshot_plan(SPEC, ParallelConfig.parse("dp2-tp2"), two_nodes, Precision.BF16).copies == ()
    zero1 = snapshot_plan(SPEC, ParallelConfig.parse("dp2-tp2-zero1"), one_node, Precision.BF16)
    assert {c.kind.value for c in zero1.copies} == {"main_param", "exp_avg", "exp_avg_sq"}
    assert [(c.sender, c.keeper) for c in zero1.copies if c.sender == 1][0] == (1, 2)
    assert all(zero1.held_bytes(r) > 0 for r in range(4))
    # dp2 with both replicas of a shard on one node: the node's loss would take them, so they are copied
    same_node = snapshot_plan(SPEC, ParallelConfig.parse("dp2-tp2"), Topology((0, 1, 0, 1)), Precision.BF16)
    assert same_node.copies and {c.keeper for c in same_node.copies if c.sender in (0, 2)} <= {1, 3}
    assert "every box has a replica" in str(snapshot_plan(SPEC, ParallelConfig.parse("dp4"), one_node))


@st.composite
def domain_losses(draw):
    """A snapshot plan (any rank -> node map), one failure domain lost (not the last), a layout of the survivors."""
    spec, layout, topology, precision = draw(cases())
    plan = snapshot_plan(spec, layout, topology, precision)
    if len(plan.domains) < 2:
        dead = frozenset()
    else:
        dead = frozenset(plan.domains[draw(st.integers(0, len(plan.domains) - 1))])
    survivors = [r for r in range(layout.world_size) if r not in dead]
    dst = draw(layouts(spec, world_size=len(survivors))) if dead else None
    return spec, plan, dead, survivors, dst


@settings(max_examples=120, **SETTINGS)
@given(domain_losses())
def test_going_back_to_a_snapshot_rebuilds_every_element_once_from_the_survivors_and_their_keepers(case):
    """The recovery switch from the survivors' own copies (``holes`` for the dead's boxes) and the
    keepers' fill pieces together write every destination element exactly once, with its value
    (the simulator); each piece comes from the survivor that keeps that box."""
    spec, plan, dead, survivors, dst = case
    if not dead:
        return
    source = snapshot_source(spec, plan, old_size=plan.layout.world_size,
                             survivors=[SnapshotHolding(r, (6,), (6,)) for r in survivors])
    assert source.step == 6 and source.members.holes == bool(source.lost)
    event("boxes from keepers" if source.lost else "replicas hold it all")
    assert {(b.tensor, b.kind, b.box) for b in source.lost} == set(source.keepers)
    for (tensor, kind, box), keeper in source.keepers.items():
        assert keeper not in dead and any((c.tensor, c.kind, c.box, c.keeper) == (tensor, kind, box, keeper)
                                          for c in plan.copies)
    process = {r: p for p, r in enumerate(survivors)}
    pieces = fill_plan(spec, dst, plan.precision, source.lost, {k: process[v] for k, v in source.keepers.items()})
    plans = plan_all(spec, plan.layout, dst, members=source.members, precision=plan.precision,
                     topology=Topology.uniform(len(survivors), 2))
    result = simulate(spec, plan.layout, dst, plans, plan.precision, members=source.members, patch=pieces)
    assert result.patched_elements == sum(p.piece.numel for p in pieces)


def test_a_snapshot_not_whole_on_the_survivors_is_refused_naming_why():
    one_node = Topology.uniform(4, 4)
    plan = snapshot_plan(SPEC, ParallelConfig.parse("dp1-tp2-pp2"), one_node, Precision.FP32)

    def held(rank, own, kept):
        return SnapshotHolding(rank, tuple(own), tuple(kept))

    with pytest.raises(StateLostError, match="not of one step"):  # a death while a snapshot was taken
        snapshot_source(SPEC, plan, old_size=4, survivors=[held(0, [6], [6]), held(2, [9], [9]), held(3, [9], [9])])
    with pytest.raises(StateLostError, match="in no survivor's snapshot copies"):  # rank 1's keeper (2) is stale
        snapshot_source(SPEC, plan, old_size=4, survivors=[held(0, [6], [6]), held(2, [6], [3]), held(3, [6], [6])])
    with pytest.raises(StateLostError, match="in no survivor's snapshot copies"):  # two neighbours in the ring
        snapshot_source(SPEC, plan, old_size=4, survivors=[held(0, [6], [6]), held(3, [6], [6])])
    source = snapshot_source(SPEC, plan, old_size=4, survivors=[held(r, [6], [6]) for r in (0, 2, 3)])
    assert set(source.keepers.values()) == {2} and source.members.src == (0, None, 1, 2)


def test_with_two_buffers_the_newest_step_whole_everywhere_is_gone_back_to():
    """Rank 1 died while the snapshot of step 9 was taken: ranks 2 and 3 had copied their own state
    of step 9, rank 0 not yet, and rank 2 (rank 1's keeper) had not received rank 1's copy of step 9.
    Every survivor still holds the snapshot of step 6 in its other buffer: the recovery goes back to 6."""
    one_node = Topology.uniform(4, 4)
    plan = snapshot_plan(SPEC, ParallelConfig.parse("dp1-tp2-pp2"), one_node, Precision.FP32)
    survivors = [SnapshotHolding(0, (6,), (6,)), SnapshotHolding(2, (6, 9), (6,)), SnapshotHolding(3, (9, 6), (6, 9))]
    assert snapshot_source(SPEC, plan, old_size=4, survivors=survivors).step == 6
    both = [SnapshotHolding(r, (6, 9), (6, 9)) for r in (0, 2, 3)]
    assert snapshot_source(SPEC, plan, old_size=4, survivors=both).step == 9
    stale_at_9 = [SnapshotHolding(0, (6, 9), (6, 9)), SnapshotHolding(2, (6, 9), (6,)), SnapshotHolding(3, (6, 9), (6, 9))]
    assert snapshot_source(SPEC, plan, old_size=4, survivors=stale_at_9).step == 6  # rank 1's copy of 9 is not kept
