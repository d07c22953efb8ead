"""``compile_switch`` over random plans, worlds 1-64, without processes.

Every rank's program is compiled, then checked together:

- every destination element is written exactly once (fills, copies, kept tensors, received parts);
- every message a rank sends is the message its peer receives in the same stage (the same boxes,
  offsets and bytes), and every broadcast's members run the same stages;
- the programs run to the end on an in-process scheduler of fake ranks (an exchange needs both
  peers at it, a broadcast all its members): no deadlock;
- stages fit the budget plus the largest row; a destination tensor is allocated before any write
  and a source tensor released exactly once, after its last read.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from lightning_dynatrain.transition import LinkCosts, compile_switch
from lightning_dynatrain.transition.program import Broadcast, Copy, Exchange, Fill, Keep, Part, SwitchProgram
from lightning_dynatrain.transition.local_state import box_pieces, box_view
from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.members import Members
from lightning_dynatrain.vps.planner import plan_all
from lightning_dynatrain.vps.spec import Precision, StateKind
from lightning_dynatrain.vps.topology import Topology
from tests.vps.strategies import layouts, small_specs

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FAVOUR_BROADCAST = LinkCosts(p2p_bytes_per_s=1.0, broadcast_bytes_per_s=1e12, broadcast_setup_s=0.0)


def _programs(spec, src, dst, precision, budget, direct_min, costs, members=None,
              weights_only=False) -> dict[int, SwitchProgram]:
    members = members or Members.same(src.world_size, dst.world_size)
    topology = Topology.uniform(members.size, 4)
    plans = plan_all(spec, src, dst, precision=precision, topology=topology, members=members,
                     weights_only=weights_only)

    def regions(layout, rank):
        return rank_regions(spec, layout, rank, precision, weights_only=weights_only) if rank is not None else {}

    return {p: compile_switch(plans[p], regions(src, members.src_rank(p)), regions(dst, members.dst_rank(p)),
                              staging_budget=budget, direct_min_bytes=direct_min, link_costs=costs, peer_plans=plans,
                              topology=topology)
            for p in range(members.size)}


@st.composite
def switches(draw):
    spec = draw(small_specs())
    src = draw(layouts(spec, max_world=draw(st.sampled_from([1, 4, 16, 64]))))
    dst = draw(layouts(spec, max_world=draw(st.sampled_from([1, 4, 16, 64]))))
    precision = draw(st.sampled_from(list(Precision)))
    budget = draw(st.sampled_from([64, 256, 4096, 2**20]))
    direct_min = draw(st.sampled_from([None, 16, 2**20]))
    costs = draw(st.sampled_from([None, FAVOUR_BROADCAST]))
    members = None
    if draw(st.booleans()):  # a world change that renumbers: processes leave, join, change rank
        size = max(src.world_size, dst.world_size) + draw(st.integers(0, 1))
        members = Members(src=tuple(draw(st.permutations(range(size)))[:src.world_size]),
                          dst=tuple(draw(st.permutations(range(size)))[:dst.world_size]), size=size)
    return spec, src, dst, precision, budget, direct_min, costs, members, draw(st.sampled_from([False, False, True]))


@settings(max_examples=60, **SETTINGS)
@given(switches())
def test_programs_are_exact_matched_deadlock_free_and_bounded(case):
    """Also weights-only programs (a rollout's switch): the params alone are read, written and released."""
    spec, src, dst, precision, budget, direct_min, costs, members, weights_only = case
    largest_row = max((p.needed_budget for p in _programs(spec, src, dst, precision, 2**30, direct_min, None, members,
                                                          weights_only).values()), default=0)
    budget = max(budget, largest_row)  # below a row, every rank refuses the switch at run time
    programs = _programs(spec, src, dst, precision, budget, direct_min, costs, members, weights_only)
    for program in programs.values():
        if weights_only:
            assert {t.key[1] for t in (*program.sources, *program.destinations)} <= {StateKind.PARAM}
        _check_life_times(program)
        _check_writes_exactly_once(program)
        for step in program.steps:
            if isinstance(step, Exchange):
                assert step.buffer_bytes <= budget + program.needed_budget
        assert program.buffer_bytes <= budget + program.needed_budget
    _check_messages_match(programs)
    _run_on_fake_ranks(programs)


def _written_parts(program: SwitchProgram):
    """``(key, region, box)`` of every destination write of a program (kept tensors: all of them)."""
    for step in program.steps:
        if isinstance(step, Fill):
            yield step.key, step.region, step.box
        elif isinstance(step, Copy):
            yield step.key, step.dest, step.box
        elif isinstance(step, Keep):
            for c in step.copies:
                yield c.key, c.dest, c.box
        elif isinstance(step, (Exchange, Broadcast)):
            parts = [p for m in step.recvs for p in m.parts] if isinstance(step, Exchange) else (
                step.parts if step.root != program.rank else [])
            for part in parts:
                for key, sub in box_pieces(part.tensor, part.kind, part.region, part.box):
                    yield key, part.region, sub


def _check_writes_exactly_once(program: SwitchProgram) -> None:
    counts = {t.key: torch.zeros(t.numel, dtype=torch.int32) for t in program.destinations}
    for key, region, box in _written_parts(program):
        box_view(counts[key], region, box).add_(1)
    for key, count in counts.items():
        assert bool((count == 1).all()), f"rank {program.rank}: {key} written {count.min()}..{count.max()} times"


def _check_life_times(program: SwitchProgram) -> None:
    allocated, released = set(), set()
    sources = {t.key for t in program.sources}
    for step in program.steps:
        assert not set(step.writes_first) & allocated, step
        allocated |= set(step.writes_first)
        if isinstance(step, Exchange):
            reads = [k for m in step.sends for p in m.parts for k, _ in box_pieces(p.tensor, p.kind, p.region, p.box)]
            early = [k for m in step.recvs if m.direct for p in m.parts
                     for k, _ in box_pieces(p.tensor, p.kind, p.region, p.box)]
            assert set(early) <= allocated, "a direct receive lands in an unallocated tensor"
        elif isinstance(step, (Copy, Keep)):
            reads = [step.key]
            assert step.key in allocated
        else:
            reads = []
        assert not set(reads) & released, f"{step}: reads a tensor already released"
        assert not set(step.reads_last) & released
        released |= set(step.reads_last)
        allocated |= set(step.writes_after)
    assert released >= sources, "a source tensor the program reads is never released"
    assert allocated == {t.key for t in program.destinations}


def _signature(parts: tuple[Part, ...]) -> list:
    return [(p.tensor, p.kind, p.box, p.offset, p.nbytes) for p in parts]


def _check_messages_match(programs: dict[int, SwitchProgram]) -> None:
    exchanges = {(r, s.peer, s.stage): s for r, p in programs.items() for s in p.steps if isinstance(s, Exchange)}
    for (rank, peer, stage), step in exchanges.items():
        other = exchanges.get((peer, rank, stage))
        assert other is not None, f"rank {rank} exchanges with {peer} in stage {stage}, {peer} does not"
        assert [_signature(m.parts) for m in step.sends] == [_signature(m.parts) for m in other.recvs]
    broadcasts: dict[tuple, list] = {}
    for rank, program in programs.items():
        for s in program.steps:
            if isinstance(s, Broadcast):
                broadcasts.setdefault((s.root, s.members, s.stage), []).append((rank, s.nbytes, _signature(s.parts)))
    for (root, members, _), seen in broadcasts.items():
        assert sorted(r for r, _, _ in seen) == list(members)
        assert len({(n, str([(t, k, b, o) for t, k, b, o, _ in sig])) for _, n, sig in seen}) == 1


def _run_on_fake_ranks(programs: dict[int, SwitchProgram]) -> None:
    """Every rank walks its steps; an exchange waits for its peer at the same stage, a broadcast for
    all its members. The programs must all finish."""
    blocking = {r: [s for s in p.steps if isinstance(s, (Exchange, Broadcast))] for r, p in programs.items()}
    at = {r: 0 for r in programs}

    def current(r):
        return blocking[r][at[r]] if at[r] < len(blocking[r]) else None

    while any(current(r) is not None for r in programs):
        progressed = False
        for r in programs:
            step = current(r)
            if isinstance(step, Exchange):
                other = current(step.peer)
                if isinstance(other, Exchange) and other.peer == r and other.stage == step.stage:
                    at[r] += 1
                    at[step.peer] += 1
                    progressed = True
            elif isinstance(step, Broadcast):
                key = (step.root, step.members, step.stage)
                if all(isinstance(current(m), Broadcast) and (current(m).root, current(m).members, current(m).stage)
                       == key for m in step.members):
                    for m in step.members:
                        at[m] += 1
                    progressed = True
        stuck = {r: str(current(r)) for r in programs if current(r) is not None}
        assert progressed, f"deadlock: {stuck}"


def test_a_program_prints_on_one_line_and_step_by_step():
    spec = build_gpt_spec("tiny", GPTDims(num_layers=2, hidden=8, num_heads=2, ffn_hidden=8, vocab_size=16))
    src, dst = ParallelConfig.parse("dp2"), ParallelConfig.parse("dp1-tp2")
    program = _programs(spec, src, dst, Precision.FP32, 4096, None, None)[0]
    line = str(program)
    assert "\n" not in line and line.startswith("rank 0 dp2-tp1-pp1->dp1-tp2-pp1:")
    text = program.describe()
    assert text.splitlines()[0] == line and len(text.splitlines()) == len(program.steps) + 1
    assert hash(program) == hash(_programs(spec, src, dst, Precision.FP32, 4096, None, None)[0])
