"""After members died mid-step (pure): the new world starts from one step, sourced only from the
survivors at that step, the newest whole one; or the error names what no survivor holds."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from lightning_dynatrain.vps.errors import StateLostError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.lost_state import lost_state
from lightning_dynatrain.vps.planner import plan_all
from lightning_dynatrain.vps.recovery_source import SurvivorState, recovery_source
from lightning_dynatrain.vps.spec import Precision
from lightning_dynatrain.vps.topology import Topology
from tests.vps.simulator import simulate
from tests.vps.strategies import layouts, small_specs
from tests.vps.test_lost_state import SPEC

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@st.composite
def mid_step_deaths(draw):
    """A layout of 2-8 ranks, some dead (not all), each survivor at step 5 or 6, a layout of the survivors."""
    spec = draw(small_specs())
    src = draw(layouts(spec, world_size=draw(st.sampled_from([2, 3, 4, 6, 8]))))
    dead = draw(st.sets(st.integers(0, src.world_size - 1), min_size=1, max_size=src.world_size - 1))
    survivors = tuple(SurvivorState(r, draw(st.sampled_from([5, 6]))) for r in range(src.world_size) if r not in dead)
    dst = draw(layouts(spec, world_size=len(survivors)))
    return spec, src, dst, survivors, draw(st.sampled_from(list(Precision)))


@settings(max_examples=150, **SETTINGS)
@given(mid_step_deaths())
def test_the_new_world_starts_from_the_newest_whole_step_and_reads_only_its_holders(case):
    spec, src, dst, survivors, precision = case
    try:
        source = recovery_source(spec, src, precision, old_size=src.world_size, survivors=survivors)
    except StateLostError as err:
        event("lost")
        for step in {s.step for s in survivors}:  # no step is whole
            empty = {r for r in range(src.world_size) if r not in {s.old_rank for s in survivors if s.step == step}}
            assert lost_state(spec, src, empty, precision)
        assert "held by no survivor" in str(err) and err.lost
        return
    holders = {s.old_rank for s in survivors if s.step == source.step}
    newer = {s.step for s in survivors if s.step > source.step}
    for step in newer:  # a newer step was not whole
        empty = {r for r in range(src.world_size) if r not in {s.old_rank for s in survivors if s.step == step}}
        assert lost_state(spec, src, empty, precision)
    event(f"from step {source.step}, {len(source.stale)} stale")
    members = source.members
    assert {members.src_rank(p) for p in range(members.size) if members.src_rank(p) is not None} == holders
    assert set(source.stale) == {s.old_rank for s in survivors} - holders
    try:
        plans = plan_all(spec, src, dst, members=members, precision=precision,
                         topology=Topology.uniform(members.size, 2))
    except StateLostError as err:  # only vocabulary padding rows may have no holder; the plan needs none
        pytest.fail(f"a whole step's plan lost state: {err}")
    stale_processes = {p for p, s in enumerate(survivors) if s.old_rank in source.stale}
    for plan in plans.values():  # nothing is read from a survivor at another step
        assert all(r.peer not in stale_processes for r in plan.recvs)
    simulate(spec, src, dst, plans, precision, members=members)  # every destination element exactly once


def test_a_mixed_step_with_a_whole_replica_goes_forward_and_zero1_is_lost():
    survivors = (SurvivorState(0, 6), SurvivorState(2, 5), SurvivorState(3, 6))
    dp2_tp2 = ParallelConfig.parse("dp2-tp2")
    # rank 1 (dp0, tp1) died; its replica rank 3 stepped, so did rank 0: step 6 is whole
    source = recovery_source(SPEC, dp2_tp2, Precision.FP32, old_size=4, survivors=survivors)
    assert (source.step, source.members.src, source.stale) == (6, (0, None, None, 2), (2,))
    # ranks 2 and 3 (dp1) had not stepped: step 5 is whole on that replica
    source = recovery_source(SPEC, dp2_tp2, Precision.FP32, old_size=4,
                             survivors=(SurvivorState(0, 6), SurvivorState(2, 5), SurvivorState(3, 5)))
    assert (source.step, source.members.src, source.stale) == (5, (None, None, 1, 2), (0,))
    # ranks 0 and 2 (tp0) stepped, rank 3 (tp1) not: step 6 lacks tp1, step 5 lacks tp0
    with pytest.raises(StateLostError, match="at step 6 are held by no survivor"):
        recovery_source(SPEC, dp2_tp2, Precision.FP32, old_size=4,
                        survivors=(SurvivorState(0, 6), SurvivorState(2, 6), SurvivorState(3, 5)))
    with pytest.raises(StateLostError, match="dead: rank 1"):
        recovery_source(SPEC, ParallelConfig.parse("dp2-tp2-zero1"), Precision.FP32, old_size=4,
                        survivors=tuple(SurvivorState(r, 5) for r in (0, 2, 3)))
