"""``execute_switch``: run one rank's ``SwitchProgram`` with a process group and a memory policy.

Everything was decided when the program was compiled (``compiler.py``); the walker checks the
state against it on every rank (``preflight``: one small all-reduce, so a switch that cannot run
raises on every rank before anything moves), then runs the steps in order: it allocates what a
step writes first, moves the bytes (``Tensor.copy_``, ``batch_isend_irecv``, ``broadcast``), and
releases what a step read last, through its memory (``switch_memory.SwitchMemory``: a device kind's policy,
``devices.memory_policy``).

The caller hands ``source`` over: on return it is empty, and the returned store holds every
destination local tensor.

Example (every rank)::

    program = compile_switch(plan, rank_regions(spec, src, rank), rank_regions(spec, dst, rank),
                             staging_budget=256 * 2**20)
    new_store, report = execute_switch(program, store, PlainMemory())
    print(report)   # one line: seconds per phase, bytes, stages, peak staging
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from datetime import timedelta
import torch
import torch.distributed as dist

from lightning_dynatrain.transition.collectives import SubgroupCache
from lightning_dynatrain.transition.comm import GroupComm
from lightning_dynatrain.transition.packing import buffer_view, pack_box, unpack_box
from lightning_dynatrain.transition.preflight import check_tensor, preflight
from lightning_dynatrain.transition.program import (
    Broadcast,
    Copy,
    Drop,
    Exchange,
    Fill,
    Keep,
    Message,
    Part,
    Step,
    StoreKey,
    SwitchProgram,
)
from lightning_dynatrain.transition.report import SwitchRecorder, SwitchReport
from lightning_dynatrain.transition.local_state import box_pieces, box_view, torch_dtype
from lightning_dynatrain.transition.switch_memory import SwitchMemory


def execute_switch(program: SwitchProgram, source: MutableMapping[StoreKey, torch.Tensor],
                   memory: SwitchMemory, *, group: dist.ProcessGroup | None = None,
                   subgroups: SubgroupCache | None = None, on_phase: Callable[[str], None] | None = None,
                   timeout: timedelta | None = None) -> tuple[dict[StoreKey, torch.Tensor], SwitchReport]:
    """Run ``program`` on this rank: move its state from the source layout to the destination's.

    Args:
        program: this rank's program (``compile_switch``); its ranks are ranks of ``group``.
        source: the rank's state in the source layout (``{(tensor, kind, stack): local tensor}``); consumed.
        memory: the memory the switch runs in (a device kind's ``switch_memory``, ``SwitchMemory``).
        group: the process group holding the union of both worlds; default the global group.
        subgroups: where promoted broadcasts' subgroups are kept across switches (needed when the
            program was compiled with link costs).
        on_phase: told ``"preflight"`` before the checks and ``"transfer"`` before the first step
            (``SwitchWatch``'s phases).
        timeout: subgroups made by this switch are created with this timeout (the switch's deadline).

    Returns:
        The destination store (every destination local tensor) and this rank's report.

    Raises:
        StagingBudgetError: the budget is smaller than a row some rank sends (on every rank).
        StateStoreError, SwitchAbortedError: the state does not match the program (on every rank).
    """
    if program.promotes and subgroups is None:
        raise ValueError("the program promotes broadcasts: pass subgroups=SubgroupCache(), kept across switches")
    device = next(iter(source.values())).device if source else None
    comm = GroupComm(group, device)
    walk = _Walk(program, source, memory, comm, SwitchRecorder(program.rank, program.topology, comm.synchronize))
    with walk.rec.phase("plan"):
        if on_phase is not None:
            on_phase("preflight")
        preflight(program, comm, source)
        if program.promotes:  # every rank's broadcast groups, made on every rank (collective)
            subgroups.ensure(program.broadcast_groups, comm, timeout=timeout)  # type: ignore[union-attr]
    if on_phase is not None:
        on_phase("transfer")
    memory.start(dict(source))
    walk.subgroups = subgroups
    walk.drop_unread()
    for step in program.steps:
        walk.run(step)
    walk.done()
    return walk.dest, walk.rec.report(src=str(program.src), dst=str(program.dst), budget=program.staging_budget)


class _Walk:
    """The mutable side of one running switch on one rank: the stores, the stage buffer, the recorder."""

    def __init__(self, program: SwitchProgram, source: MutableMapping[StoreKey, torch.Tensor], memory: SwitchMemory,
                 comm: GroupComm, rec: SwitchRecorder) -> None:
        self.program, self.source, self.memory, self.comm, self.rec = program, source, memory, comm, rec
        self.dest: dict[StoreKey, torch.Tensor] = {}
        self.shapes = {t.key: t for t in program.destinations}
        self.buffer: torch.Tensor | None = None
        self.subgroups: SubgroupCache | None = None
        self.read = {t.key for t in program.sources}

    def run(self, step: Step) -> None:
        if isinstance(step, (Keep, Copy)) and self.buffer is not None:
            self._unstage()  # no stage comes after the first retained box
        getattr(self, f"_{type(step).__name__.lower()}")(step)

    # --------------------------------------------------------------------------------- memory
    def _write(self, keys: tuple[StoreKey, ...]) -> None:
        with self.rec.phase("allocate", sync=False):
            for key in keys:
                if key not in self.dest:
                    want = self.shapes[key]
                    tensor = self.memory.allocate(key, want.numel, torch_dtype(want.dtype), self.comm.device)
                    check_tensor(key, tensor, want.numel, want.dtype, where="allocated destination")
                    self.dest[key] = tensor

    def _release(self, keys) -> None:
        # dropping a tensor whose copy is still queued is safe: the caching allocator reuses its
        # memory only for work ordered after that copy on the same stream
        with self.rec.phase("free", sync=False):
            for key in keys:
                self.memory.release(key, self.source.pop(key))

    def _stage_buffer(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = self.memory.staging(self.program.buffer_bytes, self.comm.device)
            self.rec.staging_alloc(self.buffer.numel())  # measured here, whatever the policy does
        return self.buffer

    def _unstage(self) -> None:
        assert self.buffer is not None
        self.rec.staging_free(self.buffer.numel())
        self.memory.unstage(self.buffer)
        self.buffer = None

    def done(self) -> None:
        if self.buffer is not None:
            self._unstage()
        self.rec.settle("copy")
        with self.rec.phase("free"):
            self.memory.finish()
        assert not self.source, f"source tensors still to be read: {list(self.source)[:3]}"

    # ---------------------------------------------------------------------------------- steps
    def drop_unread(self) -> None:
        """Every source tensor the program never reads goes first (the program's ``Drop``, and any
        tensor of the store its regions do not name)."""
        self._release([k for k in self.source if k not in self.read])

    def _drop(self, step: Drop) -> None:
        pass  # ``drop_unread`` gave them back already

    def _fill(self, step: Fill) -> None:
        self._write(step.writes_first)
        with self.rec.phase("copy", sync=False):
            box_view(self.dest[step.key], step.region, step.box).zero_()

    def _copy(self, step: Copy) -> None:
        self._write(step.writes_first)
        with self.rec.phase("copy", sync=False):
            to = box_view(self.dest[step.key], step.dest, step.box)
            of = box_view(self.source[step.key], step.source, step.box)
            moved = self.memory.copy(to, of, last_read=step.key in step.reads_last)
        if moved:
            self.rec.primitive("local_copy_pages", 1, moved)
        self.rec.primitive("local_copy", 1, step.nbytes)
        self.rec.retained += step.nbytes
        self._release(step.reads_last)

    def _keep(self, step: Keep) -> None:
        kept = self.memory.keep(step.key, self.source[step.key], step.span)
        if kept is None:  # the copies instead, the last one reading the old tensor for the last time
            last = len(step.copies) - 1
            for i, copy in enumerate(step.copies):
                self._copy(copy._replace(writes_first=step.writes_first, reads_last=step.reads_last if i == last else ()))
            return
        self.dest[step.key] = kept
        self.rec.primitive("in_place", 1, step.nbytes)
        self.rec.retained += step.nbytes
        self._release(step.reads_last)

    def _send_payload(self, message: Message) -> torch.Tensor:
        if message.direct:
            part = message.parts[0]
            return self._storage_bytes(self.source, part)
        buf = self._stage_buffer()
        with self.rec.phase("pack"):
            for part in message.parts:
                view = buffer_view(buf, part.offset, part.box, torch_dtype(part.region.dtype))
                pack_box(self.source.__getitem__, part.region, part.tensor, part.kind, part.box, view)
        return buf[message.start:message.start + message.nbytes]

    def _recv_payload(self, message: Message) -> torch.Tensor:
        if message.direct:
            return self._storage_bytes(self.dest, message.parts[0])
        return self._stage_buffer()[message.start:message.start + message.nbytes]

    @staticmethod
    def _storage_bytes(store, part: Part) -> torch.Tensor:
        (key, sub), = box_pieces(part.tensor, part.kind, part.region, part.box)
        return box_view(store[key], part.region, sub).reshape(-1).view(torch.uint8)

    def _unpack(self, parts) -> None:
        with self.rec.phase("unpack"):
            for part in parts:
                view = buffer_view(self._stage_buffer(), part.offset, part.box, torch_dtype(part.region.dtype))
                unpack_box(self.dest.__getitem__, part.region, part.tensor, part.kind, part.box, view)

    def _exchange(self, step: Exchange) -> None:
        """One stage with one peer: pack, send and receive at once, unpack (``Exchange``)."""
        self._write(step.writes_first)  # direct receives go straight into their tensors
        ops = [dist.P2POp(dist.isend, self._send_payload(m), group=self.comm.group, group_peer=step.peer)
               for m in step.sends]
        ops += [dist.P2POp(dist.irecv, self._recv_payload(m), group=self.comm.group, group_peer=step.peer)
                for m in step.recvs]
        with self.rec.phase("transfer"):
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self._release(step.reads_last)
        self._write(step.writes_after)
        self._unpack([p for m in step.recvs if not m.direct for p in m.parts])
        direct = [m for m in step.sends + step.recvs if m.direct]
        self.rec.stages += 1
        self.rec.primitive("p2p", len(ops), sum(m.nbytes for m in step.sends + step.recvs))
        self.rec.primitive("p2p_direct", len(direct), sum(m.nbytes for m in direct))
        self.rec.delivered(step.peer, sum(m.nbytes for m in step.sends))
        self.rec.received(step.peer, sum(m.nbytes for m in step.recvs))

    def _broadcast(self, step: Broadcast) -> None:
        """One stage of a promoted broadcast: the root packs, every member joins, receivers unpack."""
        root = self.program.rank == step.root
        buf = self._stage_buffer()
        if root:
            with self.rec.phase("pack"):
                for part in step.parts:
                    view = buffer_view(buf, part.offset, part.box, torch_dtype(part.region.dtype))
                    pack_box(self.source.__getitem__, part.region, part.tensor, part.kind, part.box, view)
        subgroup = self.subgroups.get(step.members, self.comm)  # type: ignore[union-attr]
        with self.rec.phase("transfer"):
            dist.broadcast(buf[:step.nbytes], group=subgroup, src=self.comm.global_rank(step.root))
        self._release(step.reads_last)
        self._write(step.writes_after)
        if root:
            for member in step.members:
                if member != step.root:
                    self.rec.delivered(member, step.nbytes)
        else:
            self._unpack(step.parts)
            self.rec.received(step.root, step.nbytes)
            self.rec.recv_broadcast += step.nbytes
        self.rec.stages += 1
        self.rec.primitive("broadcast", 1, step.nbytes)


__all__ = ["execute_switch"]
