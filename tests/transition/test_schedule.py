"""The XOR pairwise schedule, simulated for every world size 1-64 with random and real traffic."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lightning_dynatrain.transition.schedule import active_steps, next_pow2, xor_schedule
from lightning_dynatrain.vps.planner import plan_all
from tests.vps.strategies import layouts, small_specs

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _check(world: int, traffic: set[frozenset[int]]) -> None:
    """Symmetric (i meets j in the step j meets i) and complete (each pair with traffic met once)."""
    met: Counter[frozenset[int]] = Counter()
    steps = {r: active_steps(r, world, lambda p, r=r: frozenset((r, p)) in traffic) for r in range(world)}
    for rank, mine in steps.items():
        indices = [s.index for s in mine]
        assert indices == sorted(set(indices)), "one partner per step, steps in order"
        for step in mine:
            assert 0 <= step.peer < world and step.peer != rank
            assert (step.index, rank) in [(s.index, s.peer) for s in steps[step.peer]], "asymmetric"
            met[frozenset((rank, step.peer))] += 1
    assert set(met) == traffic, "a pair with traffic never met, or a pair without traffic met"
    assert all(n == 2 for n in met.values()), "each pair meets exactly once (seen from both sides)"


@pytest.mark.parametrize("world", range(1, 65))
def test_every_pair_meets_once_in_every_world(world):
    _check(world, {frozenset((i, j)) for i in range(world) for j in range(i + 1, world)})
    assert len(xor_schedule(0, world)) == world - 1


@settings(max_examples=200, **SETTINGS)
@given(st.integers(1, 64).flatmap(
    lambda w: st.tuples(st.just(w), st.sets(st.tuples(st.integers(0, w - 1), st.integers(0, w - 1)), max_size=200))))
def test_random_traffic_is_met_symmetrically_and_completely(case):
    world, pairs = case
    _check(world, {frozenset(p) for p in pairs if p[0] != p[1]})


@settings(max_examples=40, **SETTINGS)
@given(st.data())
def test_real_plans_are_met_symmetrically_and_completely(data):
    spec = data.draw(small_specs())
    src, dst = data.draw(layouts(spec)), data.draw(layouts(spec))
    plans = plan_all(spec, src, dst)
    traffic = {frozenset((r, t.peer)) for r, p in plans.items() for t in p.sends + p.recvs}
    _check(len(plans), traffic)


def test_next_pow2_and_absent_peers():
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 128]
    assert [(s.index, s.peer) for s in xor_schedule(1, 3)] == [(1, 0), (3, 2)]
    assert xor_schedule(0, 1) == ()
    with pytest.raises(ValueError):
        xor_schedule(3, 3)
