"""The weights-only plan (the switch to a rollout layout and back): over random models and layout
pairs it moves the params alone and writes every destination param exactly once with the right
value (the simulator is the oracle), moving the minimum; it is the full plan less the optimizer's
state, and the optimizer's state is never touched."""

from hypothesis import HealthCheck, given, settings, strategies as st

from lightning_dynatrain.vps.dryrun import dry_run
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.planner import plan_all, union_world
from lightning_dynatrain.vps.presets import preset
from lightning_dynatrain.vps.spec import Precision, StateKind
from lightning_dynatrain.vps.topology import Topology
from tests.vps.simulator import minimum_moved, simulate
from tests.vps.strategies import layouts, small_specs

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@st.composite
def rollouts(draw):
    """A training layout (zero1 often) and a rollout layout, in the same world or another."""
    spec = draw(small_specs())
    train = draw(layouts(spec))
    same_world = draw(st.booleans())
    rollout = draw(layouts(spec, world_size=train.world_size if same_world else None))
    return spec, train, rollout, draw(st.sampled_from(list(Precision))), draw(st.sampled_from([1, 2, 4]))


@settings(max_examples=30, **SETTINGS)
@given(rollouts())
def test_weights_only_switches_both_ways_are_exact_minimal_and_the_full_plans_params(case):
    spec, train, rollout, precision, gpus_per_node = case
    for src, dst in ((train, rollout), (rollout, train)):
        topology = Topology.uniform(union_world(src, dst), gpus_per_node)
        plans = plan_all(spec, src, dst, precision=precision, topology=topology, weights_only=True)
        result = simulate(spec, src, dst, plans, precision, weights_only=True)
        assert result.moved_elements == minimum_moved(spec, src, dst, precision, weights_only=True)
        assert result.moved_elements + result.retained_elements + result.filled_elements == result.dest_elements
        full = plan_all(spec, src, dst, precision=precision, topology=topology)
        for rank, plan in plans.items():
            assert plan.weights_only and "(weights only)" in str(plan)
            for name in ("sends", "recvs", "retains", "fills"):
                mine = getattr(plan, name)
                assert {t.kind for t in mine} <= {StateKind.PARAM}, (rank, name)
                assert mine == tuple(t for t in getattr(full[rank], name) if t.kind is StateKind.PARAM), (rank, name)


def test_a_dry_run_counts_the_params_in_the_dtype_they_train_in():
    spec = preset("llama2-7b")
    src, dst = ParallelConfig.parse("dp1-tp2-pp2-zero1"), ParallelConfig.parse("dp4-tp1-pp1")
    weights, _ = dry_run(spec, src, dst, precision=Precision.BF16, weights_only=True)
    full, _ = dry_run(spec, src, dst, precision=Precision.BF16)
    assert weights.weights_only and not full.weights_only
    # bf16 params, fp32 norms (megatron keeps them so), nothing else
    fp32 = sum(t.numel for t in spec.tensors if t.always_fp32)
    assert fp32 and weights.state_bytes == (spec.parameters - fp32) * 2 + fp32 * 4
    # with fp32 main params and two fp32 moments (the norms: no main param)
    assert full.state_bytes == (spec.parameters - fp32) * 14 + fp32 * 12
    # each destination rank holds every param; it held a quarter of them (tp2 x pp2)
    assert abs(weights.moved_bytes - 4 * 0.75 * weights.state_bytes) <= 0.01 * weights.moved_bytes
