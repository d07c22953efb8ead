"""Functions the multi-process engine tests run on every rank (module level, so spawn can import them).

Each runs several switches in one spawned job (a process start costs seconds) and returns small
picklable summaries the parent asserts on; element checks happen in the children.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from lightning_dynatrain.transition import (
    DIRECT_MIN_BYTES,
    LinkCosts,
    StagingBudgetError,
    SubgroupCache,
    SwitchReport,
    execute_switch,
    measure_link_costs,
)
from lightning_dynatrain.vps.layout import ParallelConfig
from tests.transition.cases import Case
from tests.transition.memory import CheckedMemory
from tests.transition.state import compare, local_state


def summary(case: Case, report: SwitchReport) -> dict:
    return {
        "case": str(case), "rank": report.rank, "peak": report.peak_staging_bytes,
        "budget": report.staging_budget_bytes, "stages": report.stages, "sent": report.sent_bytes,
        "recv": report.recv_bytes, "retained": report.retained_bytes, "p2p_ops": report.p2p.ops,
        "p2p_bytes": report.p2p.bytes, "direct_bytes": report.p2p_direct.bytes, "bcast_ops": report.broadcast.ops, "bcast_bytes": report.broadcast.bytes,
        "copy_bytes": report.local_copy.bytes, "in_place_bytes": report.in_place.bytes, "inter": report.sent_inter_node_bytes + report.recv_inter_node_bytes,
        "line": str(report),
    }


def switch_and_check(rank: int, case: Case, store: dict, src: str, dst: str, *, memory: CheckedMemory | None = None,
                     costs: LinkCosts | None = None, subgroups: SubgroupCache | None = None,
                     direct_min_bytes: int | None = DIRECT_MIN_BYTES, device: str = "cpu") -> tuple[dict, SwitchReport]:
    """Run ``src -> dst`` on this rank's ``store`` and check every element of the result."""
    spec = case.spec()
    a, b = ParallelConfig.parse(src), ParallelConfig.parse(dst)
    program = case.program(rank, src, dst, costs=costs, direct_min_bytes=direct_min_bytes)
    new, report = execute_switch(program, store, memory if memory is not None else CheckedMemory(),
                                 subgroups=subgroups)
    assert all(t.device.type == torch.device(device).type for t in new.values()), "state left its device"
    assert not store, f"rank {rank}: source tensors left in the store: {list(store)[:3]}"
    want = local_state(spec, b, rank, case.precision, filled_from=spec.padded_vocab(a.tp))
    compare(new, want, f"rank {rank} {src}->{dst} {case}")
    return new, report


def _round_trip_expectation(case: Case, store: dict, rank: int) -> dict:
    """What A -> B -> A gives back: every tensor bit for bit, except vocabulary padding rows that
    only A pads to (B has no such rows, so they come back zeroed, as the plan's fills)."""
    spec = case.spec()
    a, b = ParallelConfig.parse(case.src), ParallelConfig.parse(case.dst)
    if spec.padded_vocab(b.tp) >= spec.padded_vocab(a.tp):
        return {k: v.clone() for k, v in store.items()}
    return {k: v.to(next(iter(store.values())).device) for k, v in
            local_state(spec, a, rank, case.precision, filled_from=spec.padded_vocab(b.tp)).items()}


def run_cases(rank: int, world: int, cases: list[Case], device: str = "cpu",
              direct_min_bytes: int | None = DIRECT_MIN_BYTES) -> list[dict]:
    """Every case there and back: exact after the first switch, bit-identical after the second."""
    out = []
    for case in cases:
        store = {k: v.to(device) for k, v in local_state(case.spec(), case.src, rank, case.precision).items()}
        original = _round_trip_expectation(case, store, rank)
        new, report = switch_and_check(rank, case, store, case.src, case.dst, device=device,
                                       direct_min_bytes=direct_min_bytes)
        back, _ = switch_and_check(rank, case, new, case.dst, case.src, device=device, direct_min_bytes=direct_min_bytes)
        compare(back, original, f"rank {rank} round trip {case}")
        out.append(summary(case, report))
    return out


def run_in_place(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """Cases where whole local tensors are retained at the same local layout, with ``adopt``: those
    destination tensors must *be* the source tensors (same storage), and every element still exact."""
    out = []
    for case in cases:
        store = local_state(case.spec(), case.src, rank, case.precision)
        original = _round_trip_expectation(case, store, rank)
        storage = {k: v.data_ptr() for k, v in store.items()}
        new, report = switch_and_check(rank, case, store, case.src, case.dst, memory=CheckedMemory(keep=True))
        kept = sorted(str(k) for k, v in new.items() if storage.get(k) == v.data_ptr())
        back, _ = switch_and_check(rank, case, new, case.dst, case.src, memory=CheckedMemory(keep=True))
        compare(back, original, f"rank {rank} round trip {case}")
        out.append({**summary(case, report), "kept_tensors": kept, "in_place_ops": report.in_place.ops})
    return out


def run_slices(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """Cases where local tensors are retained whole as one run of a larger source tensor, kept in
    place: such a destination tensor must be a view into its source tensor, the policy must release
    exactly the rest of that source tensor, and every element is still exact."""
    out = []
    for case in cases:
        store = local_state(case.spec(), case.src, rank, case.precision)
        original = _round_trip_expectation(case, store, rank)
        spans = {k: (v.data_ptr(), v.data_ptr() + v.nbytes) for k, v in store.items()}
        memory = CheckedMemory(keep=True)
        new, report = switch_and_check(rank, case, store, case.src, case.dst, memory=memory)
        released: dict = {}
        for key, lo, hi in memory.released:
            released.setdefault(key, []).append((lo, hi))
        kept = {}  # kept in place, whole or as a slice
        for key, tensor in new.items():
            lo, hi = spans[key]
            if lo <= tensor.data_ptr() < hi:
                assert tensor.data_ptr() + tensor.nbytes <= hi, key
                kept[key] = (tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes)
        for key, (lo, hi) in spans.items():  # every old byte given back once, except what is kept
            parts = sorted(released.get(key, []) + ([kept[key]] if key in kept else []))
            assert parts[0][0] == lo and parts[-1][1] == hi, (key, parts, (lo, hi))
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), (key, parts)
        back, _ = switch_and_check(rank, case, new, case.dst, case.src)
        compare(back, original, f"rank {rank} round trip {case}")
        proper = [k for k, (lo, hi) in kept.items() if hi - lo < spans[k][1] - spans[k][0]]
        out.append({**summary(case, report), "sliced_tensors": len(proper),
                    "kept_bytes": sum(hi - lo for lo, hi in kept.values())})
    return out


def run_too_small(rank: int, world: int, case: Case) -> str:
    """A budget below the largest row: every rank raises StagingBudgetError and keeps its state."""
    store = local_state(case.spec(), case.src, rank, case.precision)
    original = {k: v.clone() for k, v in store.items()}
    try:
        execute_switch(case.program(rank, case.src, case.dst), store, CheckedMemory())
    except StagingBudgetError as err:
        compare(store, original, f"rank {rank}: state after a refused switch")
        # the group is still usable: nothing is left in flight
        dist.barrier()
        return str(err)
    raise AssertionError(f"rank {rank}: a budget of {case.budget} was accepted")


def run_broadcast(rank: int, world: int, cases: list[Case], costs: LinkCosts | None) -> list[dict]:
    """Cases with broadcast promotion (``costs``); one subgroup cache across all of them."""
    cache = SubgroupCache()
    out = []
    for case in cases:
        store = local_state(case.spec(), case.src, rank, case.precision)
        original = _round_trip_expectation(case, store, rank)
        program = case.program(rank, case.src, case.dst, costs=costs)
        new, report = switch_and_check(rank, case, store, case.src, case.dst, costs=costs, subgroups=cache)
        back, _ = switch_and_check(rank, case, new, case.dst, case.src, costs=costs, subgroups=cache)
        compare(back, original, f"rank {rank} round trip {case}")
        row = summary(case, report)
        row["jobs"] = len(program.broadcast_groups)
        row["subgroups"] = len(cache)
        out.append(row)
    return out


def run_subgroups(rank: int, world: int) -> dict[str, object]:
    """Broadcast subgroups over rounds in which the ranks join different numbers of them (the torch
    group names of members with different histories): on a switch's own group spanning the world,
    every round's groups meet and broadcast; on a group of three the diverging round is refused on
    every rank before anything is created."""
    from datetime import timedelta

    from lightning_dynatrain.transition import SubgroupNamingError
    from lightning_dynatrain.transition.comm import GroupComm

    def broadcast_on(cache: SubgroupCache, comm: GroupComm, sets: list[tuple[int, ...]]) -> None:
        for members in sets:
            if comm.rank in members:
                root = comm.global_rank(members[0])
                value = torch.full((4,), float(root + 1)) if comm.rank == members[0] else torch.zeros(4)
                dist.broadcast(value, group=cache.get(members, comm), src=root)
                assert torch.equal(value, torch.full((4,), float(root + 1))), f"rank {rank}: broadcast on {members}"

    switch = GroupComm(dist.new_group(list(range(world))), None)  # not WORLD, as the switch watch makes it
    cache = SubgroupCache()
    rounds = [[(0, 1, 3)], [(0, 1, 2, 3), (1, 2)], [(0, 2)]]
    for sets in rounds:  # the member sets come from one rank each time, as a plan's senders know them
        cache.ensure(sets if rank == sets[0][0] else [], switch, timeout=timedelta(seconds=30))
        broadcast_on(cache, switch, sets)
    out: dict[str, object] = {"spanning": len(cache)}
    three = dist.new_group([0, 1, 2])
    if rank < 3:
        comm = GroupComm(three, None)
        local = SubgroupCache()
        local.ensure([(0, 1)], comm, timeout=timedelta(seconds=30))  # rank 2 is not in it: one behind now
        broadcast_on(local, comm, [(0, 1)])
        try:
            local.ensure([(0, 1, 2)], comm, timeout=timedelta(seconds=30))
            out["refused"] = None
        except SubgroupNamingError as err:
            out["refused"] = str(err)
        out["local"] = len(local)
        local.close()
    cache.close()
    return out


def run_measure(rank: int, world: int) -> tuple[float, float, float]:
    costs = measure_link_costs(nbytes=2**20)
    return costs.p2p_bytes_per_s, costs.broadcast_bytes_per_s, costs.broadcast_setup_s


def run_suite(rank: int, world: int, parts: dict[str, tuple[str, tuple]]) -> dict[str, tuple[str, object]]:
    """Run several named parts in one spawned job: ``{name: ("ok", value) | ("error", traceback)}``.

    A part that raises is reported and the next part runs (every rank raises in the same part for
    the errors these tests provoke, so the group stays in step); a part that deadlocks ends the job
    by the parent's timeout.
    """
    import traceback

    out: dict[str, tuple[str, object]] = {}
    for name, (fn_name, args) in parts.items():
        try:
            out[name] = ("ok", globals()[fn_name](rank, world, *args))
        except Exception:  # reported to the parent, which fails the test of this part
            out[name] = ("error", traceback.format_exc())
        dist.barrier()
    return out


def run_bad_inputs(rank: int, world: int, case: Case) -> dict[str, str]:
    """Mistakes found before anything moves: every rank stops, with the culprit's error on its rank."""
    from lightning_dynatrain.transition import StateStoreError, SwitchAbortedError

    program = case.program(rank, case.src, case.dst)
    out = {}

    store = local_state(case.spec(), case.src, rank, case.precision)
    if rank == world - 1:
        store.pop(next(iter(store)))  # the last rank lost a tensor
    try:
        execute_switch(program, store, CheckedMemory())
        raise AssertionError("a missing source tensor was accepted")
    except (StateStoreError, SwitchAbortedError) as err:
        out["missing"] = type(err).__name__

    store = local_state(case.spec(), case.src, rank, case.precision)
    try:
        execute_switch(program, store, CheckedMemory(extra=1))
        raise AssertionError("a wrong-sized destination tensor was accepted")
    except StateStoreError as err:
        out["allocator"] = str(err)
    return out


def run_renumbered(rank: int, world: int, cases: list[tuple[Case, tuple[int, ...], tuple[int, ...]]]) -> list[dict]:
    """World changes that renumber: process ``p`` holds source rank ``src_procs.index(p)`` and will
    hold destination rank ``dst_procs.index(p)``; every element checked there and back."""
    from lightning_dynatrain.transition import compile_switch, parse_bytes
    from lightning_dynatrain.vps.members import Members
    from lightning_dynatrain.vps.planner import plan_rank
    from tests.transition.cases import regions

    out = []
    for case, src_procs, dst_procs in cases:
        spec, precision = case.spec(), case.precision
        layouts = {"src": ParallelConfig.parse(case.src), "dst": ParallelConfig.parse(case.dst)}
        procs = {"src": src_procs, "dst": dst_procs}

        def layout_rank(side: str) -> int | None:
            return procs[side].index(rank) if rank in procs[side] else None

        def state(side: str, **kwargs) -> dict:
            r = layout_rank(side)
            return local_state(spec, layouts[side], r, precision, **kwargs) if r is not None else {}

        def switch(store: dict, a: str, b: str) -> tuple[dict, SwitchReport]:
            members = Members(src=procs[a], dst=procs[b], size=world)
            plan = plan_rank(spec, layouts[a], layouts[b], rank, precision=precision, members=members)
            ra, rb = layout_rank(a), layout_rank(b)
            program = compile_switch(plan, regions(spec, layouts[a], ra, precision) if ra is not None else {},
                                     regions(spec, layouts[b], rb, precision) if rb is not None else {},
                                     staging_budget=parse_bytes(case.budget))
            return execute_switch(program, store, CheckedMemory())

        start = state("src")
        original = {k: v.clone() for k, v in start.items()}
        new, report = switch(start, "src", "dst")
        compare(new, state("dst", filled_from=spec.padded_vocab(layouts["src"].tp)), f"process {rank} {case}")
        back, _ = switch(new, "dst", "src")
        if spec.padded_vocab(layouts["dst"].tp) >= spec.padded_vocab(layouts["src"].tp):
            compare(back, original, f"process {rank} round trip {case}")
        out.append({**summary(case, report), "src_rank": layout_rank("src"), "dst_rank": layout_rank("dst")})
    return out
