"""Broadcast promotion planning (pure): which sends become broadcasts, and the same on every rank."""

from __future__ import annotations

from lightning_dynatrain.transition.collectives import LinkCosts, diverging_names, plan_broadcasts
from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.planner import plan_all
from lightning_dynatrain.vps.spec import Precision

SPEC = build_gpt_spec("tiny", GPTDims(num_layers=2, hidden=8, num_heads=2, ffn_hidden=8, vocab_size=16))
FAST_BCAST = LinkCosts(p2p_bytes_per_s=1e9, broadcast_bytes_per_s=1e9, broadcast_setup_s=1e-6)
SLOW_BCAST = LinkCosts(p2p_bytes_per_s=1e9, broadcast_bytes_per_s=1e8, broadcast_setup_s=1e-3)


def _plans(src: str, dst: str):
    return plan_all(SPEC, ParallelConfig.parse(src), ParallelConfig.parse(dst), precision=Precision.BF16)


def _itemsize(tensor: str, kind) -> int:
    return SPEC.itemsize(tensor, kind, Precision.BF16)


def test_replicas_fed_by_one_rank_are_promoted():
    plans = _plans("dp1", "dp4")
    promoted = plan_broadcasts(plans, FAST_BCAST, itemsize=_itemsize)
    assert promoted.jobs and all(j.sender == 0 and j.receivers == (1, 2, 3) for j in promoted.jobs)
    assert promoted.member_sets() == ((0, 1, 2, 3),)
    carried = {(t.tensor, t.kind, t.box) for t in plans[0].sends}
    assert {item for j in promoted.jobs for item in j.items} == carried
    # sender and receivers agree on what the broadcast carries
    for r in (1, 2, 3):
        mine = {p for p in promoted.promoted(r) if p[1] == r}
        assert mine == {p for p in promoted.promoted(0) if p[1] == r}
        assert len(mine) == len(plans[r].recvs)
    assert "bcast 0->[1, 2, 3]" in str(promoted)


def test_no_costs_or_slow_broadcast_promotes_nothing():
    plans = _plans("dp1", "dp4")
    assert plan_broadcasts(plans, None, itemsize=_itemsize).jobs == ()
    assert str(plan_broadcasts(plans, None, itemsize=_itemsize)) == "no broadcasts"
    assert plan_broadcasts(plans, SLOW_BCAST, itemsize=_itemsize).jobs == ()


def test_single_peer_sends_stay_point_to_point():
    assert plan_broadcasts(_plans("tp2", "dp2"), FAST_BCAST, itemsize=_itemsize).jobs == ()


def test_cost_model():
    costs = LinkCosts(p2p_bytes_per_s=100.0, broadcast_bytes_per_s=100.0, broadcast_setup_s=0.5)
    assert costs.p2p_seconds(100, 3) == 3.0 and costs.broadcast_seconds(100) == 1.5
    assert costs.broadcast_pays(100, 3) and not costs.broadcast_pays(100, 1)
    assert "MiB/s" in str(costs)


def test_a_subset_of_senders_plans_gives_exactly_their_jobs():
    """What ``compile_switch`` relies on: a rank plans only the senders it receives from."""
    plans = _plans("dp1-tp2", "dp4")
    whole = plan_broadcasts(plans, FAST_BCAST, itemsize=_itemsize)
    for rank in range(4):
        senders = {t.peer for t in plans[rank].recvs} | {rank}
        part = plan_broadcasts({s: plans[s] for s in senders}, FAST_BCAST, itemsize=_itemsize)
        assert part.jobs_of(rank) == whole.jobs_of(rank)


def test_locally_synchronized_names_diverge_after_a_subgroup_some_members_are_not_in():
    """torch hashes each creating member's count of named groups into a locally synchronized group's
    name: (0, 1) first leaves rank 2 one behind for (0, 1, 2); equal histories never diverge."""
    assert diverging_names({0: 5, 1: 5, 2: 5}, [(0, 1), (1, 2)]) == [((1, 2), {1: 6, 2: 5})]
    assert diverging_names({0: 5, 1: 5, 2: 5}, [(0, 1), (0, 1, 2)]) == [((0, 1, 2), {0: 6, 1: 6, 2: 5})]
    assert diverging_names({0: 5, 1: 5, 2: 5, 3: 5}, [(0, 1), (0, 1, 2, 3), (2, 3)]) == [
        ((0, 1, 2, 3), {0: 6, 1: 6, 2: 5, 3: 5})]
    assert diverging_names({0: 3, 1: 3, 2: 3, 3: 3}, [(0, 1), (2, 3), (0, 1, 2, 3)]) == []
    assert diverging_names({0: 3, 1: 4}, [(0, 1)]) == [((0, 1), {0: 3, 1: 4})]
