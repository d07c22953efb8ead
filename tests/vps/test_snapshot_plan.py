"""The snapshot plan (pure): after losing any one failure domain, every box of the state is held by a
survivor or by a snapshot kept outside that domain; nothing with a replica elsewhere is copied; and
going back to the snapshot (the survivors' own copies through the recovery switch, the dead's boxes
from their keepers) rebuilds every element of any layout of the survivors exactly once."""

from __future__ import annotations

import dataclasses
import re

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
from tests.vps.simulator import held_elements, only_held_by, simulate
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
    lost_with = {}  # domain -> what losing it takes, as boxes (computed once per domain)
    for copy in plan.copies:
        assert plan.domain_of(copy.keeper) != plan.domain_of(copy.sender)
        # only what losing the sender's domain would take is copied
        domain = plan.domain_of(copy.sender)
        if domain not in lost_with:
            lost_with[domain] = {(b.tensor, b.kind, b.box) for b in lost_state(spec, layout, plan.domains[domain],
                                                                               precision)}
        assert (copy.tensor, copy.kind, copy.box) in lost_with[domain]
    for domain in range(len(plan.domains)):
        assert plan.uncovered(spec, domain) == ()
    # the bytes, against a brute force over each rank's regions: a domain's ranks send exactly what
    # only that domain holds (each element once, at its dtype's size), and the next domain of the
    # ring keeps exactly that; on one domain nothing is copied
    held = held_elements(spec, layout, precision)
    for domain, ranks in enumerate(plan.domains):
        only = only_held_by(held, ranks) if len(plan.domains) > 1 else {}
        alone = sum(int(mask.sum()) * spec.itemsize(tensor, kind, precision) for (tensor, kind), mask in only.items())
        event("copies" if alone else "no copies")
        assert sum(plan.sent_bytes(r) for r in ranks) == alone, f"domain {ranks}"
        assert sum(plan.held_bytes(r) for r in plan.domains[(domain + 1) % len(plan.domains)]) == alone


def test_replicas_in_other_domains_need_no_snapshot_and_zero1_shards_do():
    one_node, two_nodes = Topology.uniform(4, 4), Topology.uniform(4, 2)
    assert failure_domains(one_node, 4) == ((0,), (1,), (2,), (3,))  # one node: each process its own
    assert failure_domains(two_nodes, 4) == ((0, 1), (2, 3))
    assert snapshot_plan(SPEC, ParallelConfig.parse("dp2-tp2"), two_nodes, Precision.BF16).copies == ()
    zero1 = snapshot_plan(SPEC, ParallelConfig.parse("dp2-tp2-zero1"), one_node, Precision.BF16)
    assert {c.kind.value for c in zero1.copies} == {"main_param", "exp_avg", "exp_avg_sq"}
    assert [(c.sender, c.keeper) for c in zero1.copies if c.sender == 1][0] == (1, 2)
    # each rank sends what of its zero1 shard no other rank holds (not the layernorms' state, which its
    # tp peer holds too), and its ring neighbour keeps it: of each of the 3 fp32 kinds, a quarter of
    # every decoder matrix (128 + 384 + 256 + 128 elements over the 2 layers) and half the 256-row
    # output layer (dp0) or embedding (dp1), whole in one dp shard: 1248 elements, 14976 bytes
    held = held_elements(SPEC, zero1.layout, Precision.BF16)
    for r in range(4):
        alone = only_held_by(held, [r])
        assert {k.value for (_, k), mask in alone.items() if mask.any()} == {"main_param", "exp_avg", "exp_avg_sq"}
        shard = sum(int(mask.sum()) * 4 for mask in alone.values())
        assert zero1.sent_bytes(r) == shard == 3 * 4 * ((128 + 384 + 256 + 128) // 4 + 2048 // 2) == 14976
        assert zero1.held_bytes((r + 1) % 4) == shard
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
    result = simulate(spec, plan.layout, dst, plans, plan.precision, members=source.members, patch=pieces,
                      snapshot=plan, keepers=source.keepers)
    assert result.patched_elements == sum(p.piece.numel for p in pieces)


def _recovery_of_rank_1():
    """dp1-tp2-pp2 on one node (each process its own failure domain), rank 1 dead, the survivors
    0, 2, 3 (processes 0, 1, 2) going back to the snapshot at dp3-zero1: rank 1's boxes are kept by
    rank 2 (the next domain of the ring), rank 2's by rank 3, rank 0 keeps rank 3's."""
    plan = snapshot_plan(SPEC, ParallelConfig.parse("dp1-tp2-pp2"), Topology.uniform(4, 4), Precision.FP32)
    source = snapshot_source(SPEC, plan, old_size=4, survivors=[SnapshotHolding(r, (6,), (6,)) for r in (0, 2, 3)])
    target = ParallelConfig.parse("dp3-zero1")
    plans = plan_all(SPEC, plan.layout, target, members=source.members, precision=plan.precision,
                     topology=Topology.uniform(3, 2))
    return plan, source, target, plans


def test_a_fill_piece_naming_a_survivor_that_keeps_no_copy_of_its_box_fails_the_simulation_naming_it():
    """The simulator's keepers hold only the copies the snapshot plan gave them, and a fill piece is
    written from its named keeper's copy: one lost box's keeper swapped (``dataclasses.replace`` of
    the recovery source) for survivor 3, which keeps rank 2's boxes and not rank 1's, fails naming
    the piece, the keeper the fill names and the one that keeps the box; so does a correct fill
    checked against a recovery source naming another keeper."""
    plan, source, dst, plans = _recovery_of_rank_1()
    process = {0: 0, 2: 1, 3: 2}  # old rank -> process of the new world

    def run(fill_keepers, keepers=None):
        pieces = fill_plan(SPEC, dst, plan.precision, source.lost, {k: process[v] for k, v in fill_keepers.items()})
        return simulate(SPEC, plan.layout, dst, plans, plan.precision, members=source.members, patch=pieces,
                        snapshot=plan, keepers=keepers)

    assert set(source.keepers.values()) == {2}
    assert run(source.keepers, source.keepers).patched_elements > 0
    # rank 1's (layer 0, tp1) half of linear_proj: its fill sends a piece to each of the 3 dp replicas
    tensor, kind, box = key = next(k for k in source.keepers if k[0].endswith("linear_proj.weight"))
    wrong = dataclasses.replace(source, keepers={**source.keepers, key: 3})
    named = re.escape(f"fill piece {tensor} {kind.value} ") + r".* " + re.escape(f"of lost box {box} -> process ")
    with pytest.raises(AssertionError, match=named + r"\d+: its keeper, process 2 \(old rank 3\), keeps no copy of "
                       r"that box; kept by old rank 2 \(process 1\)$"):
        run(wrong.keepers)
    with pytest.raises(AssertionError, match=r"its keeper, process 1 \(old rank 2\), is not the box's keeper in the "
                       r"recovery source \(old rank 3\)"):
        run(source.keepers, wrong.keepers)
    with pytest.raises(AssertionError, match=r"process 0 \(old rank 0\), keeps no copy of that box"):
        run({**source.keepers, key: 0})  # rank 0 keeps rank 3's boxes, none of rank 1's


@settings(max_examples=100, **SETTINGS)
@given(domain_losses(), st.data())
def test_any_lost_box_filled_from_another_survivor_fails_the_simulation(case, data):
    """Whatever the layouts and the domain lost: one lost box's keeper swapped for another survivor
    (each box has one keeper, so that one keeps no copy of it) fails the simulation naming it."""
    spec, plan, dead, survivors, dst = case
    if not dead:
        return
    source = snapshot_source(spec, plan, old_size=plan.layout.world_size,
                             survivors=[SnapshotHolding(r, (6,), (6,)) for r in survivors])
    process = {r: p for p, r in enumerate(survivors)}
    # a box with no piece to send (vocabulary padding rows ``dst`` does not have) reads no keeper
    sent = {(b.tensor, b.kind, b.box) for b in source.lost
            if fill_plan(spec, dst, plan.precision, [b], {(b.tensor, b.kind, b.box): 0})}
    swappable = [key for key in source.keepers if key in sent] if len(survivors) > 1 else []
    if not swappable:
        event("no lost box to fill")
        return
    event("a keeper swapped")
    key = data.draw(st.sampled_from(swappable))
    other = data.draw(st.sampled_from([r for r in survivors if r != source.keepers[key]]))
    assert not any((c.tensor, c.kind, c.box, c.keeper) == (*key, other) for c in plan.copies)
    wrong = dataclasses.replace(source, keepers={**source.keepers, key: other})
    patch = fill_plan(spec, dst, plan.precision, wrong.lost, {k: process[v] for k, v in wrong.keepers.items()})
    plans = plan_all(spec, plan.layout, dst, members=source.members, precision=plan.precision,
                     topology=Topology.uniform(len(survivors), 2))
    keeper = source.keepers[key]
    with pytest.raises(AssertionError, match=re.escape(f"of lost box {key[2]} -> process ") + rf"\d+: its keeper, "
                       rf"process {process[other]} \(old rank {other}\), keeps no copy of that box; kept by old rank "
                       rf"{keeper} \(process {process[keeper]}\)"):
        simulate(spec, plan.layout, dst, plans, plan.precision, members=source.members, patch=patch, snapshot=plan)


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
