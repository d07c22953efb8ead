"""In-memory snapshots of the training state, taken off the critical path (``OnNodeChange(snapshot_every=N)``).

At a boundary after optimizer step ``S`` (every ``N`` steps, and after each switch) every rank
starts ``Snapshots.take`` and trains on. A thread of its own

1. copies this rank's whole state (every local tensor the engine keys: parameters, fp32 main
   parameters, the optimizer's state; ``state_bridge.megatron_store``) and Adam's step into host
   buffers, allocated once per layout and reused, with the device kind's copier
   (``devices.snapshot_copy``: plain copies on the host, a side stream into pinned buffers on CUDA);
   the next optimizer step waits for this copy (``wait_local``, called before the step's update:
   the forward and backward overlap it);
2. sends the boxes that only this rank's failure domain holds (``vps.snapshot_plan``: a ZeRO-1
   shard, a tp/pp shard at dp1) to its *keeper*, a rank in another domain, and receives those it
   keeps for others into buffers of their own, over a gloo group of the world's processes (host
   memory travels over the host backend whatever the training backend is).

Both copies live in a *buffer* (``SnapshotBuffer``), overwritten in place by the next snapshot. With
one buffer (``buffers=1``, the default) host memory holds one copy of the rank's state and one of
what it keeps, and a death while a snapshot is being taken (between the boundary and the end of the
exchange, a fraction of the next step) leaves no whole snapshot: the recovery says so and the job
ends naming the checkpoint. With two, snapshots alternate between them: the previous snapshot stays
whole while the next is taken (twice the host memory; a recovery in that window redoes up to
``N + 1`` steps).

A recovery (``elastic/driver/snapshots.py``) reads a snapshot step ``S`` every survivor holds
whole: each survivor's own state at ``S`` (``held``: a copy the recovery's switch moves to the new
layout, the snapshot left whole for a recovery that loses another member and goes back to it again)
and the copies of the dead's boxes its keepers hold (``kept``). A grow that failed goes back in
place (``restore``, which also gives back the memory of the storages the failed switch freed).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_dynatrain.compat.torch_internals import is_registered
from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.devices.snapshot_copy import HostCopier
from lightning_dynatrain.transition.local_state import RegionIndex, StoreKey, box_pieces, box_view, torch_dtype
from lightning_dynatrain.megatron.state import MegatronState
from lightning_dynatrain.megatron.state_bridge import adam_step, megatron_store, set_adam_step
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.snapshot_plan import SnapshotCopy, SnapshotPlan
from lightning_dynatrain.vps.spec import ModelSpec, StateKind

KeptKey = tuple[str, StateKind, Box]

#: test hook: ``DYNATRAIN_SNAPSHOT_FAULT=RANK:STEP:KILL`` kills that rank (SIGKILL) as its snapshot
#: thread starts the snapshot of step ``STEP``
SNAPSHOT_FAULT_ENV = "DYNATRAIN_SNAPSHOT_FAULT"


@dataclass(frozen=True)
class SnapshotFigures:
    """What the last snapshot cost this rank."""

    step: int
    local_bytes: int
    kept_bytes: int
    host_bytes: int
    """Every snapshot buffer of this rank (its own copies and what it keeps, all buffers)."""
    sent_bytes: int
    copy_seconds: float
    exchange_seconds: float


@dataclass(frozen=True, eq=False)
class HeldState:
    """A rank's state of one step at ``layout``, held apart from any model: a snapshot's own copy
    (``Snapshots.held``), the source of a switch that goes back to it (``hot_switch(held=...)``)."""

    layout: ParallelConfig
    rank: int
    """This rank's rank in ``layout`` (in the world the snapshot was taken in)."""
    store: dict[StoreKey, torch.Tensor]
    """Every local tensor the engine keys (``state_bridge.megatron_store``'s keys)."""
    adam_step: int | None


class SnapshotBuffer:
    """One snapshot's host copies: this rank's own state and what it keeps for others, each with
    the step it holds whole (``None``: none, or being overwritten)."""

    def __init__(self) -> None:
        self.local: dict[StoreKey, torch.Tensor] = {}
        self.kept: dict[KeptKey, torch.Tensor] = {}
        self.local_step: int | None = None
        self.kept_step: int | None = None
        self.adam_step: int | None = None

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.local.values()) + sum(t.nbytes for t in self.kept.values())


class Snapshots:
    """One rank's in-memory snapshots (see the module docstring); one per process, kept across worlds."""

    def __init__(self, every: int, *, buffers: int = 1) -> None:
        if every < 1:
            raise ValueError(f"snapshot_every={every}: take a snapshot every N >= 1 steps, or pass None for none")
        if buffers not in (1, 2):
            raise ValueError(f"snapshot_buffers={buffers}: 1 (one copy, overwritten in place) or 2 (the previous "
                             "snapshot stays whole while the next is taken)")
        self.every = every
        self.layout: ParallelConfig | None = None
        self.figures: SnapshotFigures | None = None
        self._buffers = [SnapshotBuffer() for _ in range(buffers)]
        self._storage_bytes: dict[StoreKey, int] = {}  # each live tensor's storage when taken (``restore``)
        self._plan: SnapshotPlan | None = None
        self._spec: ModelSpec | None = None
        self._rank = 0
        self._regions: RegionIndex | None = None
        self._dtypes: dict[tuple[str, StateKind], torch.dtype] = {}
        self._group: dist.ProcessGroup | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._copier: HostCopier | None = None  # the state's device kind's (chosen at the first take)

    @property
    def buffers(self) -> int:
        return len(self._buffers)

    @property
    def own_steps(self) -> tuple[int, ...]:
        """The steps of this rank's whole own copies, newest first."""
        return tuple(sorted((b.local_step for b in self._buffers if b.local_step is not None), reverse=True))

    @property
    def kept_steps(self) -> tuple[int, ...]:
        """The steps of the whole copies this rank keeps for others, newest first."""
        return tuple(sorted((b.kept_step for b in self._buffers if b.kept_step is not None), reverse=True))

    def host_bytes(self) -> int:
        """Host memory the snapshot buffers hold on this rank."""
        return sum(b.nbytes() for b in self._buffers)

    # ---------------------------------------------------------------------------- taking
    def prepare(self, layout: ParallelConfig, spec: ModelSpec, plan: SnapshotPlan, rank: int) -> None:
        """A new world or layout (every rank alike, collective): its gloo group (made here) and
        ``plan``, the copies for ``layout`` over the world's failure domains; what was held goes."""
        self.wait()
        if is_registered(self._group):
            dist.destroy_process_group(self._group)
        self._group = dist.new_group(backend="gloo")  # host buffers travel over the host backend
        self.forget()
        self.layout, self._spec, self._plan, self._rank = layout, spec, plan, rank
        self._regions = RegionIndex(rank_regions(spec, layout, rank, plan.precision))
        self._dtypes = {(t.name, kind): torch_dtype(plan.precision.dtype_name(kind, t))
                        for t in spec.tensors for kind, _ in plan.precision.kinds_of(t)}

    def take(self, step: int, state: MegatronState) -> None:
        """Start the snapshot of step ``step`` of ``state`` (at the prepared layout; returns once
        the thread runs)."""
        self.wait()
        if self._error is not None:  # (a death that failed it is recovered from first, which forgets it)
            raise RuntimeError("the last in-memory snapshot failed: "
                               f"{type(self._error).__name__}: {self._error}") from self._error
        assert self._spec is not None and state.layout == self.layout, "prepare the snapshots of this layout first"
        live = megatron_store(state.chunks, state.optimizer, self._spec, state.layout, self._rank)
        self._storage_bytes = {key: tensor.untyped_storage().nbytes() for key, tensor in live.items()}
        if self._copier is None and live:
            self._copier = device_kind(next(iter(live.values())).device).host_copier()
        if self._copier is not None:
            self._copier.mark()  # what the copy comes after: this boundary's optimizer step
        # the buffer overwritten: the one not holding the newest whole own copy (the only one, with one)
        newest = self.own_steps[0] if self.own_steps else None
        target = next((b for b in self._buffers if newest is None or b.local_step != newest), self._buffers[0])
        self._copied.clear()
        self._thread = threading.Thread(target=self._run, args=(step, state, live, target), name="dynatrain-snapshot",
                                        daemon=True)
        self._thread.start()

    def _run(self, step: int, state: MegatronState, live: dict[StoreKey, torch.Tensor],
             target: SnapshotBuffer) -> None:
        try:
            if os.environ.get(SNAPSHOT_FAULT_ENV) == f"{self._rank}:{step}:KILL":  # test hook
                os.kill(os.getpid(), signal.SIGKILL)
            start = time.perf_counter()
            target.local_step = target.kept_step = None  # being overwritten
            copier = self._copier
            assert copier is not None or not live
            pairs = []
            for key, tensor in live.items():
                buffer = target.local.get(key)
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    buffer = target.local[key] = copier.host_buffer(tensor)
                pairs.append((buffer, tensor))
            if pairs:
                copier.copy(pairs)
            target.adam_step = adam_step(state.optimizer)
            target.local_step = step
            copied = time.perf_counter()
            self._copied.set()
            sent = self._exchange(step, target)
            self.figures = SnapshotFigures(step, sum(t.nbytes for t in target.local.values()),
                                           sum(t.nbytes for t in target.kept.values()), self.host_bytes(), sent,
                                           copied - start,
                                           time.perf_counter() - copied)
        except BaseException as err:  # noqa: BLE001 - reported by wait(); a dead peer ends the exchange
            self._error = err
        finally:
            self._copied.set()

    def _exchange(self, step: int, target: SnapshotBuffer) -> int:
        """Send this rank's share of ``plan.copies`` out of ``target``'s own copy, receive what it
        keeps into ``target``; the bytes sent."""
        plan, group, rank, regions = self._plan, self._group, self._rank, self._regions
        assert plan is not None and group is not None and regions is not None
        ops, sent = [], 0
        for copy in plan.copies:
            if copy.sender == rank:
                data = _box_of(target.local, regions, copy)
                ops.append(dist.P2POp(dist.isend, data, group=group, group_peer=copy.keeper))
                sent += data.nbytes
            elif copy.keeper == rank:
                key = (copy.tensor, copy.kind, copy.box)
                buffer = target.kept.get(key)
                if buffer is None:
                    buffer = target.kept[key] = torch.empty(copy.box.shape, dtype=self._dtypes[(copy.tensor, copy.kind)])
                ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=copy.sender))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        target.kept_step = step
        return sent

    # --------------------------------------------------------------------------- waiting
    def wait_local(self) -> None:
        """Until this rank's own copy is taken (before the next optimizer step changes the state)."""
        self._copied.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the snapshot in flight ended (``False``: still running after ``timeout``; a peer
        died in its exchange: the recovery's abandon of the old world ends it)."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            return False
        self._thread = None
        return True

    # --------------------------------------------------------------------------- reading
    def restore(self, state: MegatronState, step: int) -> None:
        """Write this rank's own copy of step ``step`` back into ``state`` (the layout it was taken
        at). A switch that failed may have freed some of that state's storages as it moved them
        (resized to nothing): each gets its memory back first, as large as it was when taken."""
        assert self._spec is not None and state.layout == self.layout
        held = self._buffer(step, own=True)
        live = megatron_store(state.chunks, state.optimizer, self._spec, state.layout, self._rank)
        for key, tensor in live.items():
            storage = tensor.untyped_storage()
            if storage.nbytes() < self._storage_bytes[key] and storage.resizable():
                storage.resize_(self._storage_bytes[key])
            tensor.copy_(held.local[key])
        if held.adam_step is not None:
            set_adam_step(state.optimizer, held.adam_step)

    def held(self, step: int, device: torch.device) -> "HeldState":
        """This rank's own copy of step ``step`` as a switch's source: a private copy on ``device``
        (the switch may free or keep it as it moves it; the snapshot stays whole for a recovery
        that has to go back to it again)."""
        assert self.layout is not None
        held = self._buffer(step, own=True)
        store = {key: tensor.to(device, copy=True) for key, tensor in held.local.items()}
        return HeldState(layout=self.layout, rank=self._rank, store=store, adam_step=held.adam_step)

    def restore_gradient_memory(self, state: MegatronState) -> None:
        """Give ``state``'s gradient buffers the memory a failed switch took (``take_old_buffers``),
        zeroed as at a step's start: the old model trains on (a grow that went back)."""
        for buffer in state.gradient_buffers():
            storage = buffer.untyped_storage()
            need = (buffer.storage_offset() + buffer.numel()) * buffer.element_size()
            if storage.nbytes() < need and storage.resizable():
                storage.resize_(need)
            buffer.zero_()

    def kept(self, step: int) -> dict[KeptKey, torch.Tensor]:
        """The boxes this rank keeps for others, of step ``step``."""
        return self._buffer(step, own=False).kept

    def _buffer(self, step: int, *, own: bool) -> SnapshotBuffer:
        for buffer in self._buffers:
            if (buffer.local_step if own else buffer.kept_step) == step:
                return buffer
        raise KeyError(f"no whole snapshot {'own copy' if own else 'kept copy'} of step {step} on this rank "
                       f"(own: {self.own_steps}, kept: {self.kept_steps})")

    @property
    def plan(self) -> SnapshotPlan | None:
        """The copies the snapshots held were taken with (``None``: none held)."""
        return self._plan if self.own_steps else None

    def forget(self) -> None:
        """The state moved on (a switch, a world change): what is held describes it no more."""
        self._buffers = [SnapshotBuffer() for _ in self._buffers]
        self._storage_bytes, self._error = {}, None

    def drop_group(self) -> None:
        """Forget the world's gloo group (the world was abandoned: no collective on it again)."""
        self._group = None


def _box_of(store: dict[StoreKey, torch.Tensor], regions: RegionIndex, copy: SnapshotCopy) -> torch.Tensor:
    """``copy.box`` read out of ``store``, contiguous: a view where the box is one contiguous piece
    of one local tensor (a ZeRO-1 shard, a whole tp/pp shard), else its pieces concatenated in
    row-major order."""
    region = regions.find(copy.tensor, copy.kind, copy.box)
    pieces = [box_view(store[key], region, sub) for key, sub in box_pieces(copy.tensor, copy.kind, region, copy.box)]
    if len(pieces) == 1 and pieces[0].is_contiguous():
        return pieces[0].view(copy.box.shape)
    return torch.cat([p.reshape(-1) for p in pieces]).view(copy.box.shape)


__all__ = ["HeldState", "SNAPSHOT_FAULT_ENV", "KeptKey", "SnapshotBuffer", "SnapshotFigures", "Snapshots"]
