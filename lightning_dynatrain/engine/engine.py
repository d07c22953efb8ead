"""Execute one rank's plan: keep what stays, broadcast what is promoted, exchange the rest pairwise.

``execute_switch`` runs on every rank of the switch's group, in this order (the same on every rank,
which is what keeps it free of deadlocks):

1. **plan**: index regions, check the state and agree over the group (``preflight``: one small
   all-reduce; a too-small budget or a bad store raises on every rank before anything moves),
   create promoted broadcasts' subgroups, cut every exchange into stages.
2. **retain**: copy the boxes this rank keeps from old to new storage (``Tensor.copy_``), and zero
   the plan's ``fills`` (vocabulary padding rows only the new layout has).
3. **broadcast**: the promoted broadcasts, in the plan's global order (``collectives.py``).
4. **XOR steps**: in step ``s`` exchange with rank ``rank ^ s``, stage by stage: pack the sends into
   one buffer, ``batch_isend_irecv`` both ways, unpack the receives straight into new storage.

A destination local tensor is allocated (``allocate``) just before its first write; a source local
tensor is dropped from ``source_store`` right after its last read (send packed or retain copied),
so old and new state overlap as little as the plan allows. The caller hands ``source_store`` over:
on return it is empty.

Example (every rank)::

    plan = plan_rank(spec, src, dst, rank)
    new_store, report = execute_switch(
        plan, store, rank_regions(spec, src, rank), rank_regions(spec, dst, rank),
        staging_budget="256MiB")
    print(report)   # one line: seconds per phase, bytes, stages, peak staging
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, MutableMapping

import torch
import torch.distributed as dist

from lightning_dynatrain.engine.collectives import BroadcastJob, BroadcastPlan, SubgroupCache
from lightning_dynatrain.engine.comm import GroupComm
from lightning_dynatrain.engine.errors import StateStoreError
from lightning_dynatrain.engine.packing import StagingArena, buffer_view, copy_box, pack_box, unpack_box
from lightning_dynatrain.engine.preflight import Agreement, preflight
from lightning_dynatrain.engine.report import SwitchRecorder, SwitchReport
from lightning_dynatrain.engine.schedule import active_steps
from lightning_dynatrain.engine.staging import Slot, Stage, high_offset, parse_bytes, plan_stages
from lightning_dynatrain.engine.store import (
    LocalStore,
    RegionIndex,
    RegionMap,
    StoreKey,
    box_pieces,
    box_view,
    check_local,
    local_numel,
)
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.plan import RankPlan, Transfer
from lightning_dynatrain.vps.spec import StateKind

Allocator = Callable[[StoreKey, int, torch.dtype], torch.Tensor]


def execute_switch(
    plan: RankPlan,
    source_store: LocalStore,
    source_regions: RegionMap,
    dest_regions: RegionMap,
    allocate: Allocator | None = None,
    *,
    staging_budget: int | str,
    group: dist.ProcessGroup | None = None,
    broadcasts: BroadcastPlan | None = None,
    subgroups: SubgroupCache | None = None,
    gpus_per_node: int = 8,
    device: torch.device | None = None,
) -> tuple[dict[StoreKey, torch.Tensor], SwitchReport]:
    """Move this rank's state from the source layout to the destination layout.

    Args:
        plan: this rank's plan (``plan_rank``); plan ranks are ranks of ``group``.
        source_store: the rank's state in the source layout (see ``store.py``); consumed.
        source_regions / dest_regions: ``rank_regions`` of this rank in the two layouts.
        allocate: ``allocate(key, numel, dtype)`` returns a contiguous tensor of ``numel`` elements for
            a destination local tensor (or zero1 shard), e.g. preallocated Megatron storage; default
            ``torch.empty`` on the state's device.
        staging_budget: bytes of pack/unpack buffers alive at once (``"256MiB"``, an int).
        group: the process group holding the union of both worlds; default the global group.
        broadcasts: promoted broadcasts (``plan_broadcasts``), the same on every rank; ``None``: none.
        subgroups: where the broadcasts' subgroups are created and kept; needed with ``broadcasts``.
        gpus_per_node: for the intra/inter node split of the report.
        device: where staging buffers live; default the source tensors' device, else the group's.

    Returns:
        The destination store (every local tensor of ``dest_regions``) and this rank's report.

    Raises:
        StagingBudgetError: the budget is malformed or smaller than a row some rank sends (on every rank).
        StateStoreError, SwitchAbortedError: the state does not match the plan (on every rank).
    """
    budget = parse_bytes(staging_budget)
    broadcasts = broadcasts or BroadcastPlan()
    if broadcasts.jobs and subgroups is None:
        raise ValueError("promoted broadcasts need a SubgroupCache: pass subgroups=SubgroupCache(), the same on every rank")
    if device is None and source_store:
        device = next(iter(source_store.values())).device
    comm = GroupComm(group, device)
    rec = SwitchRecorder(plan.rank, gpus_per_node, comm.synchronize)
    with rec.phase("plan"):
        src_index, dst_index = RegionIndex(source_regions), RegionIndex(dest_regions)
        world = max(ParallelConfig.parse(plan.src).world_size, ParallelConfig.parse(plan.dst).world_size)
        agreement = preflight(plan, comm, world, source_store, src_index, dst_index, budget)
        run = _Switch(plan, source_store, comm, allocate, rec, agreement, src_index, dst_index)
        if broadcasts.jobs:
            subgroups.ensure(broadcasts.member_sets(), comm)  # type: ignore[union-attr]
        promoted = broadcasts.promoted(plan.rank)
        sends = [t for t in plan.sends if (plan.rank, t.peer, t.tensor, t.kind, t.box) not in promoted]
        recvs = [t for t in plan.recvs if (t.peer, plan.rank, t.tensor, t.kind, t.box) not in promoted]
        exchanges = _plan_exchanges(plan.rank, world, sends, recvs, run.itemsize, budget)
        jobs = [(job, plan_stages([(b, run.itemsize(k)) for _, k, b in job.items], [], budget))
                for job in broadcasts.jobs_of(plan.rank)]
        run.count_reads(_source_reads(plan, exchanges, jobs))
        largest = max([s.nbytes for *_, st in exchanges for s in st] + [s.nbytes for _, st in jobs for s in st],
                      default=0)
        arena = StagingArena(largest, comm.device, rec)
    run.free_unread()
    for t in plan.retains:
        run.retain(t)
    for t in plan.fills:
        run.fill(t)
    rec.settle("copy")
    for job, stages in jobs:  # the broadcast phase, before any XOR step on every rank
        group_of_job = subgroups.get(job.members, comm)  # type: ignore[union-attr]
        for stage in stages:
            run.broadcast(job, stage, arena, group_of_job)
    for peer, mine, theirs, stages in exchanges:
        for stage in stages:
            run.exchange(peer, mine, theirs, stage, arena)
    arena.release()
    run.finish()
    return run.dest, rec.report(src=plan.src, dst=plan.dst, budget=budget)


Exchange = tuple[int, list[Transfer], list[Transfer], list[Stage]]


def _source_reads(plan: RankPlan, exchanges: list[Exchange], jobs: list[tuple[BroadcastJob, list[Stage]]]
                  ) -> list[tuple[str, StateKind, Box]]:
    """Every read of source state the switch will make: one per retain, one per chunk packed."""
    reads = [(t.tensor, t.kind, t.box) for t in plan.retains]
    for peer, mine, _, stages in exchanges:
        for stage in stages:
            slots = stage.low if plan.rank < peer else stage.high
            reads += [(mine[c.item].tensor, mine[c.item].kind, c.box) for c, _ in slots]
    for job, stages in jobs:
        if job.sender == plan.rank:
            reads += [(job.items[c.item][0], job.items[c.item][1], c.box) for stage in stages for c, _ in stage.low]
    return reads


def _plan_exchanges(rank: int, world: int, sends: list[Transfer], recvs: list[Transfer],
                    itemsize: Callable[[StateKind], int], budget: int) -> list[Exchange]:
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
        stages = plan_stages([(t.box, itemsize(t.kind)) for t in low], [(t.box, itemsize(t.kind)) for t in high], budget)
        out.append((step.peer, mine, theirs, stages))
    return out


class _Switch:
    """The mutable state of one running switch on one rank: stores, read counts, the recorder."""

    def __init__(self, plan: RankPlan, source: LocalStore, comm: GroupComm, allocate: Allocator | None,
                 rec: SwitchRecorder, agreement: Agreement, src: RegionIndex, dst: RegionIndex) -> None:
        self.plan = plan
        self.source: MutableMapping[StoreKey, torch.Tensor] = source
        self.comm = comm
        self.allocate = allocate
        self.rec = rec
        self.agreement = agreement
        self.src = src
        self.dst = dst
        self.dest_locals = dst.local_tensors()
        self.dest: dict[StoreKey, torch.Tensor] = {}
        self.reads: Counter[StoreKey] = Counter()

    def itemsize(self, kind: StateKind) -> int:
        return self.agreement.dtypes[kind].itemsize

    # ---------------------------------------------------------------- storage
    def count_reads(self, reads: list[tuple[str, StateKind, Box]]) -> None:
        """Count the reads of each source tensor the switch will make (one per chunk or retain piece)."""
        for tensor, kind, box in reads:
            region = self.src.find(tensor, kind, box)
            for key, _ in box_pieces(tensor, kind, region, box):
                self.reads[key] += 1

    def free_unread(self) -> None:
        with self.rec.phase("free", sync=False):
            for key in [k for k in self.source if self.reads[k] == 0]:
                del self.source[key]

    def read(self, key: StoreKey) -> torch.Tensor:
        return self.source[key]

    def done_reading(self, keys: list[StoreKey]) -> None:
        # dropping a tensor whose copy is still queued is safe: the caching allocator reuses its
        # memory only for work ordered after that copy on the same stream
        with self.rec.phase("free", sync=False):
            for key in keys:
                self.reads[key] -= 1
                if self.reads[key] == 0:
                    del self.source[key]

    def write(self, key: StoreKey) -> torch.Tensor:
        found = self.dest.get(key)
        if found is None:
            found = self._allocate(key)
        return found

    def _allocate(self, key: StoreKey) -> torch.Tensor:
        region = self.dest_locals[key]
        dtype = self.agreement.dtypes[key[1]]
        numel = local_numel(region)
        with self.rec.phase("allocate", sync=False):
            if self.allocate is None:
                tensor = torch.empty(numel, dtype=dtype, device=self.comm.device)
            else:
                tensor = self.allocate(key, numel, dtype)
                check_local(key, tensor, region, where="allocated destination")
                if tensor.dtype != dtype:
                    raise StateStoreError(f"allocate({key}) returned {tensor.dtype}, the state is {dtype}",
                                          hint="allocate with the dtype the engine passes")
        self.dest[key] = tensor
        return tensor

    # -------------------------------------------------------------- movement
    def retain(self, t: Transfer) -> None:
        src_region = self.src.find(t.tensor, t.kind, t.box)
        dst_region = self.dst.find(t.tensor, t.kind, t.box)
        keys = [k for k, _ in box_pieces(t.tensor, t.kind, src_region, t.box)]
        for key in keys:  # allocate outside the copy timer
            self.write(key)
        with self.rec.phase("copy", sync=False):
            pieces = copy_box(self.read, src_region, self.write, dst_region, t.tensor, t.kind, t.box)
        nbytes = t.box.numel * self.itemsize(t.kind)
        self.rec.retained += nbytes
        self.rec.primitive("local_copy", pieces, nbytes)
        self.done_reading(keys)

    def fill(self, t: Transfer) -> None:
        """Zero a destination box no source holds (vocabulary padding only the new layout has)."""
        region = self.dst.find(t.tensor, t.kind, t.box)
        for key, box in box_pieces(t.tensor, t.kind, region, t.box):
            local = self.write(key)
            with self.rec.phase("copy", sync=False):
                box_view(local, region, box).zero_()

    def _pack(self, transfers: list[Transfer], slots: tuple[Slot, ...], buf: torch.Tensor, base: int) -> list[StoreKey]:
        """Pack ``slots`` (chunks of ``transfers``) at ``base`` of ``buf``; returns the source keys read."""
        keys: list[StoreKey] = []
        with self.rec.phase("pack"):
            for chunk, offset in slots:
                t = transfers[chunk.item]
                region = self.src.find(t.tensor, t.kind, chunk.box)
                view = buffer_view(buf, base + offset, chunk.box, self.agreement.dtypes[t.kind])
                pack_box(self.read, region, t.tensor, t.kind, chunk.box, view)
                keys.extend(k for k, _ in box_pieces(t.tensor, t.kind, region, chunk.box))
        return keys

    def _unpack(self, transfers: list[Transfer], slots: tuple[Slot, ...], buf: torch.Tensor, base: int) -> None:
        placed = [(chunk, offset, transfers[chunk.item]) for chunk, offset in slots]
        regions = [self.dst.find(t.tensor, t.kind, chunk.box) for chunk, _, t in placed]
        for (chunk, _, t), region in zip(placed, regions):  # allocate outside the unpack timer
            for key, _ in box_pieces(t.tensor, t.kind, region, chunk.box):
                self.write(key)
        with self.rec.phase("unpack"):
            for (chunk, offset, t), region in zip(placed, regions):
                view = buffer_view(buf, base + offset, chunk.box, self.agreement.dtypes[t.kind])
                unpack_box(self.write, region, t.tensor, t.kind, chunk.box, view)

    def exchange(self, peer: int, mine: list[Transfer], theirs: list[Transfer], stage: Stage,
                 arena: StagingArena) -> None:
        """One stage with one peer: pack, send and receive at once, unpack."""
        low = self.plan.rank < peer
        send_slots, recv_slots = (stage.low, stage.high) if low else (stage.high, stage.low)
        send_bytes, recv_bytes = (stage.low_bytes, stage.high_bytes) if low else (stage.high_bytes, stage.low_bytes)
        send_base, recv_base = (0, high_offset(stage.low_bytes)) if low else (high_offset(stage.low_bytes), 0)
        buf = arena.get()
        keys = self._pack(mine, send_slots, buf, send_base)
        ops = []
        if send_bytes:
            ops.append(dist.P2POp(dist.isend, buf[send_base:send_base + send_bytes], group=self.comm.group,
                                  group_peer=peer))
        if recv_bytes:
            ops.append(dist.P2POp(dist.irecv, buf[recv_base:recv_base + recv_bytes], group=self.comm.group,
                                  group_peer=peer))
        with self.rec.phase("transfer"):
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.done_reading(keys)
        self._unpack(theirs, recv_slots, buf, recv_base)
        self.rec.stages += 1
        self.rec.primitive("p2p", len(ops), send_bytes + recv_bytes)
        self.rec.delivered(peer, sum(s.chunk.nbytes for s in send_slots))
        self.rec.received(peer, sum(s.chunk.nbytes for s in recv_slots))

    def broadcast(self, job: BroadcastJob, stage: Stage, arena: StagingArena, group: dist.ProcessGroup) -> None:
        """One stage of a promoted broadcast: the sender packs, every member joins, receivers unpack."""
        buf = arena.get()
        items = [Transfer(job.sender, tensor, kind, box) for tensor, kind, box in job.items]
        sending = self.plan.rank == job.sender
        if sending:
            keys = self._pack(items, stage.low, buf, 0)
        with self.rec.phase("transfer"):
            dist.broadcast(buf[:stage.low_bytes], group=group, src=self.comm.global_rank(job.sender))
        payload = sum(s.chunk.nbytes for s in stage.low)
        if sending:
            self.done_reading(keys)
            for r in job.receivers:
                self.rec.delivered(r, payload)
        else:
            self._unpack(items, stage.low, buf, 0)
            self.rec.received(job.sender, payload)
        self.rec.stages += 1
        self.rec.primitive("broadcast", 1, stage.low_bytes)

    def finish(self) -> None:
        """Allocate destination tensors nothing wrote (none, for a consistent plan) and check the source is spent."""
        for key in self.dest_locals:
            if key not in self.dest:
                self._allocate(key)
        assert not any(self.reads.values()), f"source tensors still to be read: {+self.reads}"
