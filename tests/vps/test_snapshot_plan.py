"""The snapshot plan (pure): after losing any one failure domain, every box of the state is held by a
survivor or by a snapshot kept outside that domain; nothing with a replica elsewhere is copied."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.lost_state import lost_state
from lightning_dynatrain.vps.snapshot_plan import failure_domains, snapshot_plan
from lightning_dynatrain.vps.spec import Precision
from lightning_dynatrain.vps.topology import Topology
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
