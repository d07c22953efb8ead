"""``compile_switch``: one rank's plan and regions in, its ``SwitchProgram`` out. Pure and deterministic.

Every rank compiles its own program from inputs every rank can compute (the plans, the regions,
the budget, the link costs), so peers agree on every stage, message and broadcast without talking:
rank ``i``'s messages to ``j`` in a stage are cut exactly as ``j``'s receives from ``i``.

What the compiler decides (the walker only executes it):

1. **promotion** (``collectives.plan_broadcasts``): a box a sender sends to two or more peers
   travels as one broadcast when the measured ``link_costs`` say that pays; the jobs of this rank
   (as sender, or as receiver: from the plans of the senders it receives from, ``peer_plans``),
   run first, in the global order every member shares;
2. **exchanges**: the XOR schedule (``schedule.py``) of the remaining sends and receives, each
   pair's boxes cut into stages that fit the budget (``staging.plan_stages``), each stage side
   into messages: a chunk of ``direct_min_bytes`` or more alone, per local tensor, sent from or
   received into the state's storage where it is contiguous there; smaller ones packed together;
3. **retains**: a destination local tensor retained whole is a ``Keep`` (the old tensor, or one
   contiguous run of it, becomes the new one when the memory policy accepts; ``adoption.py``),
   other retained boxes ``Copy`` steps, one per local tensor, last: a rank done with its peers
   copies while the others still exchange;
4. **life times**: where each destination local tensor is first written and each source tensor
   last read, so the walker allocates and frees without counting.

Example::

    program = compile_switch(plan_rank(spec, src, dst, rank), rank_regions(spec, src, rank),
                             rank_regions(spec, dst, rank), staging_budget=256 * 2**20)
    print(program)             # one line
    print(program.describe())  # one line per step
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from types import MappingProxyType

from lightning_dynatrain.transition.adoption import contiguous_run, kept_in_place_keys
from lightning_dynatrain.transition.collectives import BroadcastJob, LinkCosts, plan_broadcasts
from lightning_dynatrain.transition.errors import EngineInternalError
from lightning_dynatrain.transition.program import (
    Broadcast,
    Copy,
    Drop,
    Exchange,
    Fill,
    Keep,
    LocalTensor,
    Message,
    Part,
    Step,
    StoreKey,
    SwitchProgram,
)
from lightning_dynatrain.transition.schedule import active_steps
from lightning_dynatrain.transition.staging import Slot, Stage, high_offset, plan_stages, smallest_unit_bytes
from lightning_dynatrain.transition.local_state import RegionIndex, RegionMap, box_pieces, local_numel, stack_axes, stack_indices, \
    with_stack
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import Region, rank_regions
from lightning_dynatrain.vps.members import Members
from lightning_dynatrain.vps.plan import RankPlan, Transfer
from lightning_dynatrain.vps.planner import plan_rank_cached
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind
from lightning_dynatrain.vps.topology import Topology

#: Chunks from this size on skip the pack buffer where their storage is contiguous: at 1 MiB the
#: per-message cost is well below the cost of copying the chunk twice (pack and unpack).
DIRECT_MIN_BYTES = 2**20

_NO_PLANS: Mapping[int, RankPlan] = MappingProxyType({})


def compile_switch(
    plan: RankPlan,
    source_regions: RegionMap,
    dest_regions: RegionMap,
    *,
    staging_budget: int,
    direct_min_bytes: int | None = DIRECT_MIN_BYTES,
    link_costs: LinkCosts | None = None,
    peer_plans: Mapping[int, RankPlan] = _NO_PLANS,
    topology: Topology | None = None,
) -> SwitchProgram:
    """The program of ``plan.rank`` for its switch (see the module docstring).

    Args:
        plan: this rank's plan (``plan_rank``); plan ranks are ranks of the switch's group.
        source_regions / dest_regions: ``rank_regions`` of this rank in the two layouts.
        staging_budget: bytes of stage buffers alive at once.
        direct_min_bytes: chunks of this many bytes or more travel as their own message, from and
            into the state's storage where contiguous there; ``None``: everything is packed.
        link_costs: the group's measured link speeds, the same on every rank (``measure_link_costs``):
            broadcasts are promoted where they pay; ``None`` promotes nothing.
        peer_plans: with ``link_costs``, the plans of the ranks this rank receives from (a
            broadcast's receivers come from its sender's plan).
        topology: the node of every rank of the union world (default: nodes of 8).

    Raises:
        EngineInternalError: the plan and the regions disagree (a bug, not an input error).
        ValueError: ``link_costs`` without the plan of a rank this rank receives from.
    """
    src, dst = RegionIndex(source_regions), RegionIndex(dest_regions)
    world = plan.world
    topology = topology.covers(world) if topology is not None else Topology.uniform(world, 8)

    def itemsize(tensor: str, kind: StateKind) -> int:
        size = dst.itemsize(tensor, kind) or src.itemsize(tensor, kind)
        if size is None:
            raise EngineInternalError(f"{tensor}:{kind.value} is in neither layout's regions of rank {plan.rank}")
        return size

    jobs = _promoted_jobs(plan, peer_plans, link_costs, itemsize)
    promoted = {(j.sender, r, t, k, b) for j in jobs for r in j.receivers for t, k, b in j.items}
    sends = [t for t in plan.sends if (plan.rank, t.peer, t.tensor, t.kind, t.box) not in promoted]
    recvs = [t for t in plan.recvs if (t.peer, plan.rank, t.tensor, t.kind, t.box) not in promoted]
    cut = _Cutter(src, dst, direct_min_bytes)
    raw: list[_Raw] = []
    raw += [_fill(piece) for t in plan.fills for piece in _per_local(t, dst)]
    for job in jobs:
        stages = plan_stages([(b, itemsize(t, k)) for t, k, b in job.items], [], staging_budget)
        raw += [cut.broadcast(plan.rank, job, i, stage) for i, stage in enumerate(stages)]
    for peer, mine, theirs, stages in _exchanges(plan.rank, world, sends, recvs, itemsize, staging_budget):
        raw += [cut.exchange(plan.rank, peer, i, stage, mine, theirs) for i, stage in enumerate(stages)]
    raw += _retains(plan, src, dst)
    steps, sources, destinations = _life_times(raw, src, dst, plan.rank)
    rows = [smallest_unit_bytes(t.box, itemsize(t.tensor, t.kind)) for t in plan.sends + plan.recvs]
    return SwitchProgram(
        rank=plan.rank, src=plan.src, dst=plan.dst, topology=topology, staging_budget=staging_budget,
        needed_budget=max(rows, default=0),
        buffer_bytes=max([r.buffer for r in raw], default=0),
        sources=sources, destinations=destinations,
        promotes=link_costs is not None, broadcast_groups=tuple(sorted({j.members for j in jobs})), steps=steps,
        group_size=plan.world,
    )


@lru_cache(maxsize=64)
def switch_program(spec: ModelSpec, src: ParallelConfig, dst: ParallelConfig, rank: int, precision: Precision, *,
                   staging_budget: int, topology: Topology, link_costs: LinkCosts | None = None,
                   direct_min_bytes: int | None = DIRECT_MIN_BYTES, members: Members | None = None,
                   weights_only: bool = False) -> SwitchProgram:
    """Process ``rank``'s program for ``src -> dst`` of ``spec``: planned and compiled, cached by
    everything it depends on (a new world has new members, a new topology, new link costs: a new
    program). ``members``: which process holds each layout rank (default: the same).
    ``weights_only``: the params alone (a rollout's switch): the optimizer's state is neither read
    nor released, it stays where it is."""
    members = members or Members.same(src.world_size, dst.world_size)
    plan = plan_rank_cached(spec, src, dst, rank, precision, topology, members, weights_only)
    peers = {r: plan_rank_cached(spec, src, dst, r, precision, topology, members, weights_only)
             for r in sorted({t.peer for t in plan.recvs})} if link_costs is not None else {}

    def regions(layout: ParallelConfig, layout_rank: int | None) -> RegionMap:
        return rank_regions(spec, layout, layout_rank, precision, weights_only=weights_only) \
            if layout_rank is not None else {}

    return compile_switch(plan, regions(src, members.src_rank(rank)), regions(dst, members.dst_rank(rank)),
                          staging_budget=staging_budget, direct_min_bytes=direct_min_bytes, link_costs=link_costs,
                          peer_plans=peers, topology=topology)


# ----------------------------------------------------------------------------- what moves where
def _promoted_jobs(plan: RankPlan, peer_plans: Mapping[int, RankPlan], costs: LinkCosts | None,
                   itemsize: Callable[[str, StateKind], int]) -> tuple[BroadcastJob, ...]:
    """The promoted broadcasts this rank takes part in, in the global order (see ``collectives``)."""
    if costs is None:
        return ()
    senders = sorted({t.peer for t in plan.recvs})
    missing = [s for s in senders if s not in peer_plans]
    if missing:
        raise ValueError(f"rank {plan.rank}: promotion needs the plans of the ranks it receives from; missing "
                         f"{missing}. HINT: pass peer_plans={{r: plan_rank(..., rank=r) for r in those ranks}}")
    plans = {s: peer_plans[s] for s in senders} | {plan.rank: plan}
    return plan_broadcasts(plans, costs, itemsize=itemsize, member=plan.rank).jobs


Exchanges = list[tuple[int, list[Transfer], list[Transfer], list[Stage]]]


def _exchanges(rank: int, world: int, sends: list[Transfer], recvs: list[Transfer],
               itemsize: Callable[[str, StateKind], int], budget: int) -> Exchanges:
    """Per XOR step with traffic: ``(peer, my sends, my receives, stages)``."""
    if rank >= world:
        return []
    send_to: dict[int, list[Transfer]] = {}
    recv_from: dict[int, list[Transfer]] = {}
    for t in sends:
        send_to.setdefault(t.peer, []).append(t)
    for t in recvs:
        recv_from.setdefault(t.peer, []).append(t)
    out = []
    for step in active_steps(rank, world, lambda p: p in send_to or p in recv_from):
        mine, theirs = send_to.get(step.peer, []), recv_from.get(step.peer, [])
        low, high = (mine, theirs) if rank < step.peer else (theirs, mine)
        stages = plan_stages([(t.box, itemsize(t.tensor, t.kind)) for t in low],
                             [(t.box, itemsize(t.tensor, t.kind)) for t in high], budget)
        out.append((step.peer, mine, theirs, stages))
    return out


def _per_local(t: Transfer, index: RegionIndex) -> list[tuple[StoreKey, Box, Region]]:
    region = index.find(t.tensor, t.kind, t.box)
    return [(key, box, region) for key, box in box_pieces(t.tensor, t.kind, region, t.box)]


# ------------------------------------------------------------------------------ steps, unannotated
class _Raw:
    """A step before life times: the step's fields, and the local tensors it reads and writes."""

    __slots__ = ("make", "reads", "early", "late", "buffer")

    def __init__(self, make: Callable[..., Step], reads: list[StoreKey], early: list[StoreKey],
                 late: list[StoreKey], buffer: int = 0) -> None:
        self.make, self.reads, self.early, self.late, self.buffer = make, reads, early, late, buffer


def _fill(piece: tuple[StoreKey, Box, Region]) -> _Raw:
    key, box, region = piece
    return _Raw(lambda first, last, after: Fill(key, box, region, first, last, after), [], [key], [])


def _keys(parts: tuple[Part, ...] | list[Part]) -> list[StoreKey]:
    return [k for p in parts for k, _ in box_pieces(p.tensor, p.kind, p.region, p.box)]


class _Cutter:
    """Cuts stages into messages (``direct_min``), with each side's regions."""

    def __init__(self, src: RegionIndex, dst: RegionIndex, direct_min: int | None) -> None:
        self.src, self.dst, self.direct_min = src, dst, direct_min

    def _parts(self, transfers: list[Transfer], slots: tuple[Slot, ...], index: RegionIndex, base: int) -> list[Part]:
        """``slots`` as parts at ``base`` of the stage buffer, a chunk of ``direct_min`` bytes or more cut
        into its local tensors (one layer, one expert each). Both sides cut alike: the stack axes are
        the logical tensor's, the same in both layouts."""
        out: list[Part] = []
        for chunk, offset in slots:
            t = transfers[chunk.item]
            region = index.find(t.tensor, t.kind, chunk.box)
            n = stack_axes(region)
            if self.direct_min is None or chunk.nbytes < self.direct_min or not n:
                out.append(Part(t.tensor, t.kind, chunk.box, region, base + offset))
                continue
            subs = [with_stack(chunk.box, s) for s in stack_indices(chunk.box, n)]
            size = subs[0].numel * chunk.itemsize
            out += [Part(t.tensor, t.kind, sub, region, base + offset + i * size) for i, sub in enumerate(subs)]
        return out

    def _messages(self, parts: list[Part]) -> tuple[Message, ...]:
        """Each part of ``direct_min`` bytes or more alone (direct where contiguous in its local
        tensor), runs of smaller ones packed together. Both sides cut alike."""
        out: list[Message] = []
        run: list[Part] = []
        for part in parts:
            if self.direct_min is not None and part.nbytes >= self.direct_min:
                if run:
                    out.append(Message(tuple(run), False))
                    run = []
                out.append(Message((part,), _contiguous(part)))
            else:
                run.append(part)
        if run:
            out.append(Message(tuple(run), False))
        return tuple(out)

    def exchange(self, rank: int, peer: int, index: int, stage: Stage, mine: list[Transfer],
                 theirs: list[Transfer]) -> _Raw:
        low = rank < peer
        send_slots, recv_slots = (stage.low, stage.high) if low else (stage.high, stage.low)
        send_base, recv_base = (0, high_offset(stage.low_bytes)) if low else (high_offset(stage.low_bytes), 0)
        sends = self._messages(self._parts(mine, send_slots, self.src, send_base))
        recvs = self._messages(self._parts(theirs, recv_slots, self.dst, recv_base))
        direct = [p for m in recvs if m.direct for p in m.parts]
        packed = [p for m in recvs if not m.direct for p in m.parts]
        # the buffer is the stage's layout (packed parts sit at their stage offsets): needed whole
        # as soon as one message of this side packs
        buffer = stage.nbytes if any(not m.direct for m in sends + recvs) else 0
        return _Raw(lambda first, last, after: Exchange(peer, index, sends, recvs, buffer, first, last, after),
                    _keys([p for m in sends for p in m.parts]), _keys(direct), _keys(packed), buffer)

    def broadcast(self, rank: int, job: BroadcastJob, index: int, stage: Stage) -> _Raw:
        items = [Transfer(job.sender, tensor, kind, box) for tensor, kind, box in job.items]
        root = rank == job.sender
        parts = tuple(self._parts_packed(items, stage.low, self.src if root else self.dst))
        reads, late = (_keys(parts), []) if root else ([], _keys(parts))
        return _Raw(lambda first, last, after: Broadcast(job.sender, job.members, index, parts, stage.low_bytes,
                                                         first, last, after),
                    reads, [], late, stage.low_bytes)

    @staticmethod
    def _parts_packed(items: list[Transfer], slots: tuple[Slot, ...], index: RegionIndex) -> list[Part]:
        return [Part(items[c.item].tensor, items[c.item].kind, c.box, index.find(items[c.item].tensor, items[c.item].kind,
                                                                                  c.box), offset) for c, offset in slots]


def _contiguous(part: Part) -> bool:
    """Whether ``part`` (inside one local tensor) is one contiguous run of it, as stored."""
    region, n = part.region, stack_axes(part.region)
    if any(h - l != 1 for l, h in zip(part.box.lo[:n], part.box.hi[:n])):
        return False
    if region.flat is None:
        outer_origin, outer_shape = region.origin[n:], region.view_shape
    else:  # a zero1 shard: the box is contiguous in the shard's segment of the local tensor
        outer_origin, outer_shape = region.box.lo[n:], region.box.shape[n:]
    return contiguous_run(outer_origin, outer_shape, part.box.lo[n:], part.box.shape[n:]) is not None


def _retains(plan: RankPlan, src: RegionIndex, dst: RegionIndex) -> list[_Raw]:
    """Copies of retained boxes, one per local tensor; a destination tensor retained whole is one
    ``Keep`` at its first copy's place, holding its copies for when it cannot be kept."""
    whole, runs = kept_in_place_keys(plan.retains, src, dst)
    src_locals = src.local_tensors()
    copies: dict[StoreKey, list[Copy]] = {}
    order: list[StoreKey | Copy] = []
    for t in plan.retains:
        src_region, dst_region = src.find(t.tensor, t.kind, t.box), dst.find(t.tensor, t.kind, t.box)
        for key, box in box_pieces(t.tensor, t.kind, dst_region, t.box):
            copy = Copy(key, box, src_region, dst_region, (), ())
            if key in whole or key in runs:
                if key not in copies:
                    order.append(key)
                copies.setdefault(key, []).append(copy)
            else:
                order.append(copy)
    out = []
    for item in order:
        if isinstance(item, Copy):
            out.append(_Raw(lambda first, last, after, c=item: c._replace(writes_first=first, reads_last=last),
                            [item.key], [item.key], []))
            continue
        key, span = item, runs.get(item)
        group = tuple(copies[key])
        numel = local_numel(src_locals[key])
        out.append(_Raw(lambda first, last, after, k=key, s=span, g=group, n=numel:
                        Keep(k, s, g, last, n, first), [key] * len(group), [key], []))
    return out


# -------------------------------------------------------------------------------------- life times
def _life_times(raw: list[_Raw], src: RegionIndex, dst: RegionIndex, rank: int
                ) -> tuple[tuple[Step, ...], tuple[LocalTensor, ...], tuple[LocalTensor, ...]]:
    """Steps with what each writes first and reads last; a ``Drop`` of unread sources first."""
    last_read: dict[StoreKey, int] = {}
    first_write: dict[StoreKey, tuple[int, bool]] = {}  # key -> (step, early)
    for i, r in enumerate(raw):
        for key in r.reads:
            last_read[key] = i
        for key in r.early:
            first_write.setdefault(key, (i, True))
        for key in r.late:
            first_write.setdefault(key, (i, False))
    src_locals, dst_locals = src.local_tensors(), dst.local_tensors()
    unwritten = [k for k in dst_locals if k not in first_write]
    if unwritten:
        raise EngineInternalError(f"rank {rank}: the plan writes nothing into {len(unwritten)} destination local "
                                  f"tensors, e.g. {unwritten[:3]}; the planner and the regions disagree")
    reads_at: dict[int, list[StoreKey]] = {}
    writes_at: dict[tuple[int, bool], list[StoreKey]] = {}
    for key, i in last_read.items():
        reads_at.setdefault(i, []).append(key)
    for key, at in first_write.items():
        writes_at.setdefault(at, []).append(key)
    steps: list[Step] = []
    unread = tuple(k for k in src_locals if k not in last_read)
    if unread:
        steps.append(Drop(unread))
    for i, r in enumerate(raw):
        steps.append(r.make(tuple(writes_at.get((i, True), ())), tuple(reads_at.get(i, ())),
                            tuple(writes_at.get((i, False), ()))))

    def described(locals_: dict[StoreKey, Region], keys) -> tuple[LocalTensor, ...]:
        return tuple(LocalTensor(k, local_numel(locals_[k]), locals_[k].dtype) for k in keys)

    return tuple(steps), described(src_locals, last_read), described(dst_locals, dst_locals)


__all__ = ["DIRECT_MIN_BYTES", "compile_switch", "switch_program"]
