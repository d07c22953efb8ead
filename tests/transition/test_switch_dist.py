"""The engine on real torch.distributed (gloo, spawned processes), world sizes 2 and 4.

Each world runs one spawned job (process starts cost seconds) holding many switches; the children
check every destination element bit for bit and the round trip A -> B -> A, the parent checks the
reports: staging peak within budget, bytes sent equal bytes received, broadcasts counted.

Covered: dp, tp, pp, zero1, MoE with ep2 (and etp != tp), bf16 params with fp32 optimizer state,
world changes 1 -> 4, 2 -> 4, 4 -> 3, budgets that force many stages and split boxes, a budget too
small (refused on every rank before anything moves), and broadcast promotion.
"""

from __future__ import annotations

import pytest

from lightning_dynatrain.transition import LinkCosts
from lightning_dynatrain.vps.gpt_spec import GPTDims
from lightning_dynatrain.vps.spec import Precision
from tests.dist import run_distributed
from tests.transition.cases import Case, random_cases
from tests.transition.jobs import run_suite

BF16, FP32 = Precision.BF16, Precision.FP32

DENSE = GPTDims(num_layers=4, hidden=8, num_heads=4, num_query_groups=4, head_dim=2, ffn_hidden=8, vocab_size=13,
                seq_length=8, make_vocab_size_divisible_by=4, tied_embeddings=True, add_bias_linear=True,
                normalization="LayerNorm", position_embedding="learned_absolute")
GQA = GPTDims(num_layers=2, hidden=8, num_heads=8, num_query_groups=4, head_dim=4, ffn_hidden=12, vocab_size=37,
              seq_length=8, make_vocab_size_divisible_by=8, qk_layernorm=True)
MOE = GPTDims(num_layers=2, hidden=8, num_heads=4, num_query_groups=2, head_dim=2, ffn_hidden=8, vocab_size=21,
              seq_length=8, make_vocab_size_divisible_by=4, num_experts=4, moe_ffn_hidden=4, shared_expert_ffn=4,
              tied_embeddings=True)
# wide enough that zero1 shard boundaries fall inside tensors (at dp3, dp4), not only between them
WIDE = GPTDims(num_layers=2, hidden=24, num_heads=4, num_query_groups=2, head_dim=6, ffn_hidden=20, vocab_size=50,
               seq_length=8, make_vocab_size_divisible_by=8)
WIDE_MOE = GPTDims(num_layers=2, hidden=12, num_heads=4, num_query_groups=2, head_dim=4, ffn_hidden=8, vocab_size=30,
                   seq_length=8, make_vocab_size_divisible_by=4, num_experts=4, moe_ffn_hidden=12, shared_expert_ffn=8)

# forces every multi-peer send to a broadcast
FAVOUR_BROADCAST = LinkCosts(p2p_bytes_per_s=1.0, broadcast_bytes_per_s=1e12, broadcast_setup_s=0.0)

WORLD2 = [
    Case(DENSE, "dp2", "tp2"),
    Case(DENSE, "tp2", "pp2-zero1", BF16),
    Case(DENSE, "dp2-zero1", "tp2", BF16, budget=256),
    Case(GQA, "pp2-zero1", "dp2-zero1", FP32, budget=160),
    Case(MOE, "dp2-ep2-zero1", "tp2-zero1", BF16),
    *random_cases(2, 4, src_world=2, dst_world=2),
]

WORLD4 = [
    Case(DENSE, "dp2-tp2", "tp2-pp2-zero1", BF16),
    Case(DENSE, "dp4-zero1", "tp4", FP32, budget=128),
    Case(DENSE, "dp2-pp2-zero1", "dp4-zero1", BF16, gpus_per_node=1),
    Case(GQA, "tp4", "dp2-pp2-zero1", FP32, budget=136),
    Case(MOE, "dp4-ep2-zero1", "dp2-tp2-ep2-etp1", BF16),
    Case(MOE, "dp2-tp2-ep2", "dp2-pp2-ep2-zero1", FP32, budget=200),
    Case(MOE, "dp4-ep4-zero1", "dp1-tp2-pp2-zero1", BF16),
    Case(WIDE, "dp4-zero1", "dp2-pp2-zero1", BF16, budget=512),
    Case(WIDE_MOE, "dp4-ep2-zero1", "dp4-zero1", FP32),
    # world changes inside the 4-process group
    Case(DENSE, "dp2", "dp2-tp2-zero1", BF16),
    Case(DENSE, "dp1-tp2-zero1", "dp4-zero1", BF16),
    Case(DENSE, "dp4-zero1", "dp3-zero1", BF16, budget=100),
    Case(GQA, "dp2-tp2", "dp3"),
    Case(WIDE, "dp2-tp2-zero1", "dp3-zero1", BF16, budget=400),
    Case(MOE, "dp1", "dp4-ep2-zero1", BF16),
    *random_cases(4, 4, src_world=4, dst_world=4),
    *random_cases(24, 2, src_world=2, dst_world=4, moe=True),
    *random_cases(43, 2, src_world=4, dst_world=3),
]

BROADCAST = [
    Case(DENSE, "dp1", "dp4", BF16),
    Case(DENSE, "dp1-tp2", "dp2-tp2-zero1", FP32, budget=256),
    Case(MOE, "dp1-tp2", "dp4-ep2-zero1", BF16),
]

# whole local tensors retained at the same local layout: kept in place with ``adopt``
IN_PLACE = [
    Case(DENSE, "dp2", "pp2", BF16),          # each rank keeps its layers, takes the others' moments
    Case(DENSE, "dp2", "dp2-zero1", FP32),    # every param kept; moments resharded
    Case(WIDE, "dp2-zero1", "dp1-pp2-zero1", FP32),
]

# whole destination tensors retained as one run of a larger source tensor: kept as slices with
# ``adopt_views``
SLICES = [
    Case(DENSE, "dp2", "tp2", FP32),          # first-axis shards of each replica kept, second-axis ones copied
    Case(WIDE, "dp2-pp1", "dp1-tp2", BF16),
]
# turning zero1 on keeps everything: params whole, each rank's zero1 share of the rest as a slice
# (at dp4 shard boundaries fall inside tensors: those shares are parts of the old tensors)
SLICES4 = [Case(WIDE, "dp4", "dp4-zero1", BF16)]

TOO_SMALL = Case(DENSE, "dp2-tp2", "dp4-zero1", FP32, budget=8)

# world changes that renumber (process p holds src rank src_procs.index(p), dst rank dst_procs.index(p)):
# rank 1 of 4 leaves (the survivors become ranks 0, 1, 2); a joiner takes rank 0; ranks swap places
RENUMBERED = [
    (Case(DENSE, "dp2-tp2-zero1", "dp3-zero1", BF16, budget=400), (0, 1, 2, 3), (0, 2, 3)),
    (Case(WIDE, "dp2-pp1", "dp1-tp2-pp2", FP32), (1, 2), (3, 1, 0, 2)),
    (Case(MOE, "dp4-ep2-zero1", "dp2-tp2-ep2", BF16), (3, 2, 1, 0), (1, 0, 3, 2)),
]


@pytest.fixture(scope="module")
def world2():
    parts = {"cases": ("run_cases", (WORLD2,)), "bad_inputs": ("run_bad_inputs", (Case(DENSE, "dp2", "tp2"),)),
             "in_place": ("run_in_place", (IN_PLACE,)), "slices": ("run_slices", (SLICES,))}
    return run_distributed(run_suite, 2, parts, timeout_s=120)


@pytest.fixture(scope="module")
def world4():
    parts = {
        "cases": ("run_cases", (WORLD4,)),
        "too_small": ("run_too_small", (TOO_SMALL,)),
        "slices": ("run_slices", (SLICES4,)),
        "broadcast": ("run_broadcast", (BROADCAST, FAVOUR_BROADCAST)),
        "no_promotion": ("run_broadcast", (BROADCAST[:1], None)),
        "measure": ("run_measure", ()),
        "subgroups": ("run_subgroups", ()),
        # every chunk of 16 bytes or more as its own message, from and into storage where contiguous
        "direct": ("run_cases", (WORLD4[:9], "cpu", 16)),
        "renumbered": ("run_renumbered", (RENUMBERED,)),
    }
    return run_distributed(run_suite, 4, parts, timeout_s=240)


def _part(results: list[dict], name: str) -> list:
    values = []
    for rank, result in enumerate(results):
        status, value = result[name]
        assert status == "ok", f"part {name!r} failed on rank {rank}:\n{value}"
        values.append(value)
    return values


def _check_reports(per_rank: list[list[dict]]) -> None:
    for rows in zip(*per_rank):  # one case, every rank
        case = rows[0]["case"]
        for row in rows:
            assert row["peak"] <= row["budget"], f"{case}: rank {row['rank']} staged {row['peak']} bytes"
        assert sum(r["sent"] for r in rows) == sum(r["recv"] for r in rows), f"{case}: bytes sent != received"
        assert sum(r["p2p_bytes"] for r in rows) % 2 == 0, f"{case}: p2p bytes are not paired"
        for row in rows:
            assert row["copy_bytes"] + row["in_place_bytes"] == row["retained"], f"{case}: retained bytes split"


def test_world2_switches_are_exact_and_round_trip(world2):
    reports = _part(world2, "cases")
    _check_reports(reports)
    rows = {r["case"]: r for r in reports[0]}
    assert rows[str(WORLD2[0])]["sent"] == 0, "dp2 -> tp2 keeps everything locally"
    assert rows[str(WORLD2[2])]["stages"] > 1, "a 256-byte budget needs several stages"


def test_whole_retained_tensors_are_kept_in_place(world2):
    per_rank = _part(world2, "in_place")
    _check_reports(per_rank)
    for rows in zip(*per_rank):
        case = rows[0]["case"]
        assert any(r["in_place_bytes"] for r in rows), f"{case}: nothing kept in place"
        for r in rows:  # a tensor kept in place is the very source tensor, and only those are
            assert len(r["kept_tensors"]) == r["in_place_ops"] or "zero1" in case, (case, r["kept_tensors"])
            assert bool(r["kept_tensors"]) == bool(r["in_place_bytes"]), (case, r)


def _check_slices(per_rank: list[list[dict]]) -> None:
    _check_reports(per_rank)  # every element checked in the children, there and back
    for rows in zip(*per_rank):
        for r in rows:
            assert r["kept_bytes"] == r["in_place_bytes"], (r["case"], r["kept_bytes"], r["in_place_bytes"])
        assert sum(r["sliced_tensors"] for r in rows) > 0, (rows[0]["case"], "nothing kept as a slice")


def test_first_axis_shards_of_a_replica_are_kept_as_slices_of_it(world2):
    per_rank = _part(world2, "slices")
    _check_slices(per_rank)
    for r in (r for rows in per_rank for r in rows):
        assert r["copy_bytes"] > 0, (r["case"], "second-axis shards are copied")


def test_zero1_shares_of_whole_tensors_are_kept_as_slices_of_them(world4):
    per_rank = _part(world4, "slices")
    _check_slices(per_rank)
    for r in (r for rows in per_rank for r in rows):
        assert r["copy_bytes"] == 0 and r["in_place_bytes"] == r["retained"] > 0, r


def test_without_an_adopter_preallocated_storage_is_copied_into(world2):
    for row in _part(world2, "cases")[0]:
        assert row["in_place_bytes"] == 0, row["case"]


def test_bad_state_is_refused_on_every_rank(world2):
    results = _part(world2, "bad_inputs")
    assert [r["missing"] for r in results] == ["SwitchAbortedError", "StateStoreError"]
    for r in results:  # dp2 -> tp2 keeps everything: each rank allocates before any exchange
        assert "allocated destination" in r["allocator"] and "HINT" in r["allocator"]


def test_world4_switches_are_exact_and_round_trip(world4):
    reports = _part(world4, "cases")
    _check_reports(reports)
    inter = sum(row["inter"] for per_rank in reports for row in per_rank)
    assert inter > 0, "with 2 ranks per node some bytes cross nodes"


def test_big_chunks_travel_straight_from_and_into_storage(world4):
    per_rank = _part(world4, "direct")
    _check_reports(per_rank)  # and every element was checked bit for bit, there and back, in the children
    for rows in zip(*per_rank):
        if sum(r["p2p_bytes"] for r in rows):
            assert sum(r["direct_bytes"] for r in rows) > 0, f"{rows[0]['case']}: nothing went direct"
    coalesced = _part(world4, "cases")
    assert all(r["direct_bytes"] == 0 for rows in coalesced for r in rows)  # tiny chunks: one buffer per stage


def test_world_changes_leave_only_sends_or_only_receives(world4):
    reports = _part(world4, "cases")
    index = [str(c) for c in WORLD4].index(str(Case(DENSE, "dp4-zero1", "dp3-zero1", BF16, budget=100)))
    leaving = reports[3][index]
    assert leaving["recv"] == 0 and leaving["retained"] == 0 and leaving["sent"] > 0
    index = [str(c) for c in WORLD4].index(str(Case(DENSE, "dp2", "dp2-tp2-zero1", BF16)))
    joining = reports[3][index]
    assert joining["sent"] == 0 and joining["retained"] == 0 and joining["recv"] > 0


def test_too_small_budget_is_refused_on_every_rank(world4):
    messages = _part(world4, "too_small")
    for message in messages:
        assert "staging budget 8 B (8 bytes) is too small" in message
        assert "raise staging_budget to at least" in message
    assert len({m.split("HINT")[1] for m in messages}) == 1, "every rank names the same minimum"


def test_broadcast_promotion_is_exact_and_counted(world4):
    reports = _part(world4, "broadcast")
    _check_reports(reports)
    first = [per_rank[0] for per_rank in reports]  # dp1 -> dp4: rank 0 feeds three replicas
    assert first[0]["jobs"] > 0
    assert first[0]["bcast_ops"] > 0 and first[0]["p2p_ops"] == 0
    assert all(r["bcast_ops"] == first[0]["bcast_ops"] for r in first), "every member joins every broadcast"
    assert first[0]["sent"] == 3 * first[1]["recv"]
    assert reports[0][-1]["subgroups"] >= 1


def test_without_costs_nothing_is_promoted(world4):
    reports = _part(world4, "no_promotion")
    _check_reports(reports)
    assert all(r[0]["jobs"] == 0 and r[0]["bcast_ops"] == 0 for r in reports)
    assert reports[0][0]["p2p_ops"] > 0


def test_broadcast_subgroups_meet_whatever_each_rank_joined_before(world4):
    """Members of different histories (issue: ranks waiting on differently named groups in a switch's
    preflight under load): over the switch's own group every subgroup meets; over a group of three,
    a diverging one is refused on every rank with the ranks named."""
    results = _part(world4, "subgroups")
    assert [r["spanning"] for r in results] == [4] * 4
    refusals = [r["refused"] for r in results[:3]]
    assert all(r is not None and "(0, 1, 2)" in r and "{0: " in r for r in refusals), refusals
    assert len(set(refusals)) == 1, "every rank refuses the same subgroup"
    assert [r["local"] for r in results[:3]] == [1, 1, 1], "nothing is created by a refused ensure"


def test_measured_link_costs_agree_on_every_rank(world4):
    costs = _part(world4, "measure")
    assert all(c == costs[0] for c in costs)
    p2p, bcast, setup = costs[0]
    assert p2p > 0 and bcast > 0 and setup >= 0


def test_world_changes_that_renumber_processes_are_exact(world4):
    per_rank = _part(world4, "renumbered")
    _check_reports(per_rank)  # every element checked there and back in the children
    leaving = per_rank[1][0]  # rank 1 leaves dp2-tp2-zero1 -> dp3-zero1: it only sends
    assert leaving["dst_rank"] is None and leaving["recv"] == 0 and leaving["retained"] == 0 and leaving["sent"] > 0
    joining = per_rank[3][1]  # process 3 joins as dst rank 0
    assert (joining["src_rank"], joining["dst_rank"]) == (None, 0) and joining["sent"] == 0 and joining["recv"] > 0
