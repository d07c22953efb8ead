"""Execute one rank's plan: keep what stays, broadcast what is promoted, exchange the rest pairwise.

``execute_switch`` runs on every rank of the switch's group, in this order (the same on every rank,
which is what keeps it free of deadlocks):

1. **plan**: index regions, check the state and agree over the group (``preflight``: one small
   all-reduce; a too-small budget or a bad store raises on every rank before anything moves),
   create promoted broadcasts' subgroups, cut every exchange into stages.
2. **fill**: zero the plan's ``fills`` (vocabulary padding rows only the new layout has).
3. **broadcast**: the promoted broadcasts, in the plan's global order (``collectives.py``).
4. **XOR steps**: in step ``s`` exchange with rank ``rank ^ s``, stage by stage: pack the sends into
   one buffer, ``batch_isend_irecv`` both ways, unpack the receives straight into new storage. A
   chunk of at least ``direct_min_bytes`` travels as its own message, straight from old storage or
   into new storage where it is contiguous there (no pack or unpack copy); smaller chunks coalesce.
5. **retain**: keep in place the local tensors the plan retains whole with an unchanged local
   layout (``adoption.py``: the new store takes the old tensor, no copy), or as one contiguous run of
   a larger old tensor (with ``adopt_views``: a view into it), copy the other boxes this
   rank keeps from old to new storage (``Tensor.copy_``). Last, so that a rank done with its peers
   copies while other pairs still exchange.

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

from lightning_dynatrain.engine.adoption import Adopter, kept_in_place_keys, owns_storage, take_over
from lightning_dynatrain.engine.collectives import BroadcastJob, BroadcastPlan, SubgroupCache
from lightning_dynatrain.engine.comm import GroupComm
from lightning_dynatrain.engine.errors import StateStoreError
from lightning_dynatrain.engine.packing import StagingArena, StagingPages, buffer_view, pack_box, unpack_box
from lightning_dynatrain.engine.preflight import preflight
from lightning_dynatrain.engine.report import SwitchRecorder, SwitchReport
from lightning_dynatrain.engine.schedule import active_steps
from lightning_dynatrain.engine.staging import Chunk, Slot, Stage, high_offset, parse_bytes, plan_stages
from lightning_dynatrain.engine.store import (
    LocalStore,
    RegionIndex,
    RegionMap,
    StoreKey,
    box_pieces,
    box_view,
    check_local,
    local_numel,
    stack_axes,
    stack_indices,
    torch_dtype,
    with_stack,
)
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.plan import RankPlan, Transfer
from lightning_dynatrain.vps.spec import StateKind

Allocator = Callable[[StoreKey, int, torch.dtype], torch.Tensor]
PageCopier = Callable[[torch.Tensor, torch.Tensor], int | None]

#: Chunks from this size on skip the pack buffer where their storage is contiguous: at 1 MiB the
#: per-message cost is well below the cost of copying the chunk twice (pack and unpack).
DIRECT_MIN_BYTES = 2**20


def execute_switch(
    plan: RankPlan,
    source_store: LocalStore,
    source_regions: RegionMap,
    dest_regions: RegionMap,
    allocate: Allocator | None = None,
    *,
    adopt: Adopter | None = None,
    adopt_views: bool = False,
    release: Callable[[StoreKey, torch.Tensor], None] | None = None,
    staging_budget: int | str,
    direct_min_bytes: int | None = DIRECT_MIN_BYTES,
    group: dist.ProcessGroup | None = None,
    broadcasts: BroadcastPlan | None = None,
    subgroups: SubgroupCache | None = None,
    gpus_per_node: int = 8,
    device: torch.device | None = None,
    staging_pages: StagingPages | None = None,
    copy_pages: PageCopier | None = None,
) -> tuple[dict[StoreKey, torch.Tensor], SwitchReport]:
    """Move this rank's state from the source layout to the destination layout.

    Args:
        plan: this rank's plan (``plan_rank``); plan ranks are ranks of ``group``.
        source_store: the rank's state in the source layout (see ``store.py``); consumed.
        source_regions / dest_regions: ``rank_regions`` of this rank in the two layouts.
        allocate: ``allocate(key, numel, dtype)`` returns a contiguous tensor of ``numel`` elements for
            a destination local tensor (or zero1 shard), e.g. preallocated Megatron storage; default
            ``torch.empty`` on the state's device.
        adopt: ``adopt(key, source_tensor) -> bool`` makes a destination local tensor that the plan
            retains whole, at the same local layout, *be* the source tensor (no copy, no allocation);
            ``False`` declines and the engine allocates and copies. Default: without ``allocate`` the
            engine's store takes such tensors over; with ``allocate``, nothing is adopted. A source
            tensor that is a view into a storage shared with others is offered only when every
            tensor in that storage can be kept, or with ``adopt_views``.
        adopt_views: offer views into shared storages to ``adopt`` as well, and slices of larger
            source tensors (a destination local tensor the plan retains whole from one contiguous
            run of its source tensor, ``adoption.slice_keys``); the caller then gives back the
            memory of the other tensors in such a storage, and of the parts of a sliced tensor
            outside its slice, as they are released (e.g. ``OldStateMemory.kept``), or it stays
            alive with the kept tensor.
        release: ``release(key, source_tensor)`` is called once the switch no longer needs a source
            tensor (after its last read; at once for one nothing reads), never for one kept in place
            whole; for one kept as a slice, once per part outside the slice (1-D views of it).
            Where other objects still hold the old tensors (a megatron model), this is where their
            memory can go. Never called before the preflight has agreed on every rank.
        staging_budget: bytes of pack/unpack buffers alive at once (``"256MiB"``, an int).
        direct_min_bytes: a chunk this big or bigger travels as its own message, straight from the
            old storage and into the new where it is contiguous there; ``None``: every chunk of a
            stage is packed into one buffer per direction.
        group: the process group holding the union of both worlds; default the global group.
        broadcasts: promoted broadcasts (``plan_broadcasts``), the same on every rank; ``None``: none.
        subgroups: where the broadcasts' subgroups are created and kept; needed with ``broadcasts``.
        gpus_per_node: for the intra/inter node split of the report.
        device: where staging buffers live; default the source tensors' device, else the group's.
        staging_pages: backs the staging buffer by memory already touched when it is allocated, and
            takes it over when the last stage is done (``StorageRecycler`` on CPU); default: fresh
            memory, freed after the last stage.
        copy_pages: ``copy_pages(dst, src) -> bytes moved | None`` copies a retained piece by
            exchanging its whole pages with the destination's (``StorageRecycler.copy_by_pages`` on
            CPU), or declines with ``None`` and the engine copies it; offered only the last read of
            a source tensor, whose memory there is never read again.

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
        preflight(plan, comm, world, source_store, src_index, dst_index, budget)
        if adopt is None and allocate is None:
            adopt = take_over
        run = _Switch(plan, source_store, comm, allocate, rec, src_index, dst_index, adopt,
                      direct_min_bytes, release, adopt_views, copy_pages)
        if broadcasts.jobs:
            subgroups.ensure(broadcasts.member_sets(), comm)  # type: ignore[union-attr]
        promoted = broadcasts.promoted(plan.rank)
        sends = [t for t in plan.sends if (plan.rank, t.peer, t.tensor, t.kind, t.box) not in promoted]
        recvs = [t for t in plan.recvs if (t.peer, plan.rank, t.tensor, t.kind, t.box) not in promoted]
        exchanges = _plan_exchanges(plan.rank, world, sends, recvs, run.itemsize, budget)
        jobs = [(job, plan_stages([(b, run.itemsize(t, k)) for t, k, b in job.items], [], budget))
                for job in broadcasts.jobs_of(plan.rank)]
        run.count_reads(_source_reads(plan, exchanges, jobs))
        largest = max([s.nbytes for *_, st in exchanges for s in st] + [s.nbytes for _, st in jobs for s in st],
                      default=0)
        arena = StagingArena(largest, comm.device, rec, staging_pages)
    run.free_unread()
    for t in plan.fills:
        run.fill(t)
    for job, stages in jobs:  # the broadcast phase, before any XOR step on every rank
        group_of_job = subgroups.get(job.members, comm)  # type: ignore[union-attr]
        for stage in stages:
            run.broadcast(job, stage, arena, group_of_job)
    for peer, mine, theirs, stages in exchanges:
        for stage in stages:
            run.exchange(peer, mine, theirs, stage, arena)
    arena.release()
    # retains last: a rank with no more peers copies while the others still exchange, instead of
    # keeping its first peer waiting for its copies
    for t in plan.retains:
        run.retain(t)
    rec.settle("copy")
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
                    itemsize: Callable[[str, StateKind], int], budget: int) -> list[Exchange]:
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


class _Switch:
    """The mutable state of one running switch on one rank: stores, read counts, the recorder."""

    def __init__(self, plan: RankPlan, source: LocalStore, comm: GroupComm, allocate: Allocator | None,
                 rec: SwitchRecorder, src: RegionIndex, dst: RegionIndex,
                 adopt: Adopter | None, direct_min: int | None,
                 release: Callable[[StoreKey, torch.Tensor], None] | None, adopt_views: bool = False,
                 copy_pages: PageCopier | None = None) -> None:
        self.plan = plan
        self.copy_pages = copy_pages
        self.source: MutableMapping[StoreKey, torch.Tensor] = source
        self.comm = comm
        self.allocate = allocate
        self.rec = rec
        self.src = src
        self.dst = dst
        self.dest_locals = dst.local_tensors()
        self.dest: dict[StoreKey, torch.Tensor] = {}
        self.reads: Counter[StoreKey] = Counter()
        self.adopt = adopt
        self.direct_min = direct_min
        self.release = release
        whole, runs = kept_in_place_keys(plan.retains, src, dst) if adopt is not None else (frozenset(), {})
        self.adoptable = whole
        self.sliceable = runs if adopt_views else {}  # a slice: only where the caller gives the rest back
        self.adopted: set[StoreKey] = set()
        self.adopt_views = adopt_views
        self._sharing: dict[int, set[StoreKey]] = {}  # storage -> every source key in it, before any is dropped
        if self.adoptable and not adopt_views:
            for key, tensor in source.items():
                self._sharing.setdefault(tensor.untyped_storage().data_ptr(), set()).add(key)

    def dtype(self, tensor: str, kind: StateKind) -> torch.dtype:
        """The dtype ``kind`` of ``tensor`` is stored in (the regions say: every rank agrees)."""
        name = self.dst.dtype_name(tensor, kind) or self.src.dtype_name(tensor, kind)
        assert name is not None, f"{tensor}:{kind.value} is in neither layout of rank {self.plan.rank}"
        return torch_dtype(name)

    def itemsize(self, tensor: str, kind: StateKind) -> int:
        return self.dtype(tensor, kind).itemsize

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
                self._drop(key)

    def _drop(self, key: StoreKey) -> None:
        tensor = self.source.pop(key)
        if self.release is None:
            return
        if key not in self.adopted:
            self.release(key, tensor)
        elif key in self.sliceable:  # the parts of the old tensor around the slice kept in place
            start, stop = self.sliceable[key]
            flat = tensor.view(-1)
            for rest in (flat[:start], flat[stop:]):
                if rest.numel():
                    self.release(key, rest)

    def read(self, key: StoreKey) -> torch.Tensor:
        return self.source[key]

    def done_reading(self, keys: list[StoreKey]) -> None:
        # dropping a tensor whose copy is still queued is safe: the caching allocator reuses its
        # memory only for work ordered after that copy on the same stream
        with self.rec.phase("free", sync=False):
            for key in keys:
                self.reads[key] -= 1
                if self.reads[key] == 0:
                    self._drop(key)

    def write(self, key: StoreKey) -> torch.Tensor:
        found = self.dest.get(key)
        if found is None:
            found = self._allocate(key)
        return found

    def _allocate(self, key: StoreKey) -> torch.Tensor:
        region = self.dest_locals[key]
        dtype = self.dtype(key[0], key[1])
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
    def _kept_in_place(self, key: StoreKey) -> bool:
        """Whether ``key``'s destination is its source tensor, or a slice of it (adopting it at the
        first retain)."""
        if key in self.adopted:
            return True
        if key in self.dest:
            return False
        tensor = self.source[key]
        if key in self.adoptable:
            if not self._storage_kept_whole(tensor):
                return False
        elif key in self.sliceable and tensor.is_contiguous():
            start, stop = self.sliceable[key]
            tensor = tensor.view(-1)[start:stop]
        else:
            return False
        if not self.adopt(key, tensor):  # type: ignore[misc]
            return False
        self.dest[key] = tensor
        self.adopted.add(key)
        return True

    def _storage_kept_whole(self, tensor: torch.Tensor) -> bool:
        """Keeping ``tensor`` keeps its whole storage alive: only when it is all of it, or when every
        source tensor in that storage can be kept in place too (e.g. tensors a previous switch
        carved out of one recycled storage), so no part of an old buffer stays alive unused."""
        if owns_storage(tensor):
            return True
        if not tensor.is_contiguous():
            return False
        return self.adopt_views or self._sharing.get(tensor.untyped_storage().data_ptr(), {None}) <= self.adoptable

    def retain(self, t: Transfer) -> None:
        src_region = self.src.find(t.tensor, t.kind, t.box)
        dst_region = self.dst.find(t.tensor, t.kind, t.box)
        pieces = list(box_pieces(t.tensor, t.kind, dst_region, t.box))
        itemsize = self.itemsize(t.tensor, t.kind)
        copied = copied_bytes = 0
        for key, sub in pieces:  # piece by piece: each old local tensor goes as soon as it is copied
            if not self._kept_in_place(key):
                dest = self.write(key)  # allocated outside the copy timer
                with self.rec.phase("copy", sync=False):
                    to, of = box_view(dest, dst_region, sub), box_view(self.read(key), src_region, sub)
                    moved = self.copy_pages(to, of) if self.copy_pages is not None and self.reads[key] == 1 else None
                    if moved is None:
                        to.copy_(of)
                    else:
                        self.rec.primitive("local_copy_pages", 1, moved)
                copied += 1
                copied_bytes += sub.numel * itemsize
            self.done_reading([key])
        self.rec.retained += t.box.numel * itemsize
        self.rec.primitive("local_copy", copied, copied_bytes)
        self.rec.primitive("in_place", len(pieces) - copied, t.box.numel * itemsize - copied_bytes)

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
                view = buffer_view(buf, base + offset, chunk.box, self.dtype(t.tensor, t.kind))
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
                view = buffer_view(buf, base + offset, chunk.box, self.dtype(t.tensor, t.kind))
                unpack_box(self.write, region, t.tensor, t.kind, chunk.box, view)

    def _parts(self, transfers: list[Transfer], slots: tuple[Slot, ...], index: RegionIndex) -> tuple[Slot, ...]:
        """``slots`` with each chunk of ``direct_min`` bytes or more cut into its local tensors (one
        layer, one expert each), at their offsets in the chunk's packed bytes. Both sides cut alike:
        the stack axes are the logical tensor's, the same in both layouts."""
        if self.direct_min is None:
            return slots
        out: list[Slot] = []
        for slot in slots:
            chunk = slot.chunk
            if chunk.nbytes < self.direct_min:
                out.append(slot)
                continue
            t = transfers[chunk.item]
            n = stack_axes(index.find(t.tensor, t.kind, chunk.box))
            subs = [with_stack(chunk.box, s) for s in stack_indices(chunk.box, n)] if n else [chunk.box]
            size = subs[0].numel * chunk.itemsize
            out.extend(Slot(Chunk(chunk.item, sub, chunk.itemsize), slot.offset + i * size) for i, sub in enumerate(subs))
        return tuple(out)

    def _messages(self, slots: tuple[Slot, ...]) -> list[tuple[Slot, ...]]:
        """A stage side (``_parts``) cut into messages: each part of ``direct_min`` bytes or more
        alone, runs of smaller ones together. Both sides cut alike: it depends on the parts only."""
        out: list[tuple[Slot, ...]] = []
        run: list[Slot] = []
        for slot in slots:
            if self.direct_min is not None and slot.chunk.nbytes >= self.direct_min:
                if run:
                    out.append(tuple(run))
                    run = []
                out.append((slot,))
            else:
                run.append(slot)
        if run:
            out.append(tuple(run))
        return out

    def _storage_bytes(self, transfers: list[Transfer], message: tuple[Slot, ...], *, source: bool
                       ) -> tuple[torch.Tensor, StoreKey] | None:
        """A lone big chunk's bytes in old (``source``) or new storage, when contiguous there."""
        if len(message) != 1 or self.direct_min is None or message[0].chunk.nbytes < self.direct_min:
            return None
        t, box = transfers[message[0].chunk.item], message[0].chunk.box
        index = self.src if source else self.dst
        region = index.find(t.tensor, t.kind, box)
        pieces = list(box_pieces(t.tensor, t.kind, region, box))
        if len(pieces) != 1:
            return None
        key, sub = pieces[0]
        view = box_view(self.read(key) if source else self.write(key), region, sub)
        if not view.is_contiguous():
            return None
        return view.reshape(-1).view(torch.uint8), key

    def exchange(self, peer: int, mine: list[Transfer], theirs: list[Transfer], stage: Stage,
                 arena: StagingArena) -> None:
        """One stage with one peer: pack, send and receive at once, unpack.

        Each message (``_messages``) is one ``isend``/``irecv``; a lone big part goes straight from
        or into state storage when it is contiguous there, everything else through the stage buffer.
        """
        low = self.plan.rank < peer
        send_slots, recv_slots = (stage.low, stage.high) if low else (stage.high, stage.low)
        send_base, recv_base = (0, high_offset(stage.low_bytes)) if low else (high_offset(stage.low_bytes), 0)

        def span(base: int, message: tuple[Slot, ...]) -> torch.Tensor:  # the buffer only when used
            return arena.get()[base + message[0].offset:base + message[-1].offset + message[-1].chunk.nbytes]

        ops, keys, to_unpack = [], [], []
        direct = [0, 0]  # ops, bytes
        for message in self._messages(self._parts(mine, send_slots, self.src)):
            found = self._storage_bytes(mine, message, source=True)
            if found is None:
                keys += self._pack(mine, message, arena.get(), send_base)
                payload = span(send_base, message)
            else:
                payload, key = found
                keys.append(key)
                direct[0], direct[1] = direct[0] + 1, direct[1] + payload.numel()
            ops.append(dist.P2POp(dist.isend, payload, group=self.comm.group, group_peer=peer))
        for message in self._messages(self._parts(theirs, recv_slots, self.dst)):
            found = self._storage_bytes(theirs, message, source=False)
            if found is None:
                to_unpack.extend(message)
                payload = span(recv_base, message)
            else:
                payload = found[0]
                direct[0], direct[1] = direct[0] + 1, direct[1] + payload.numel()
            ops.append(dist.P2POp(dist.irecv, payload, group=self.comm.group, group_peer=peer))
        with self.rec.phase("transfer"):
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.done_reading(keys)
        if to_unpack:
            self._unpack(theirs, tuple(to_unpack), arena.get(), recv_base)
        self.rec.stages += 1
        self.rec.primitive("p2p", len(ops), sum(op.tensor.numel() for op in ops))
        self.rec.primitive("p2p_direct", *direct)
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
