"""The host's memory policy: a switch's new state written into memory its old state touched (CPU).

``RecyclingMemory`` is a ``devices.memory_policy.PlainMemory`` whose old storages go to a ``StorageRecycler``
(``recycler.py``) instead of the OS: new params and moments are carved out of them or backed by
their pages (``page_moves.py``), retained pieces copied by their pages where they can be, the stage
buffer backed by old pages, and megatron's new DDP buffers built into the old gradient buffers
(``buffer_mode``: ``carve_buffers.switch_buffers``). ``HostKind.switch_memory`` chooses it.

Example (an engine-only switch)::

    new_store, report = execute_switch(program, store, RecyclingMemory(idle_cap=256 * 2**20))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from lightning_dynatrain.devices.host.recycler import StorageRecycler
from lightning_dynatrain.transition.program import StoreKey
from lightning_dynatrain.devices.old_storage import BUFFER_GROUP, Sink, state_group
from lightning_dynatrain.devices.memory_policy import BufferMode, Destination, MemoryFigures, PlainMemory


class RecyclingMemory(PlainMemory):
    """New state written into old memory (CPU): see the module docstring.

    Args:
        idle_cap: bytes of old storage held for carving beyond what is reserved (the switch's
            staging budget is a good value: the memory bound counts it).
        buffer_mode: makes the mode library code builds its new buffers under, from the recycler
            (``CarveBuffers``); ``None``: the buffers are allocated as usual.
    """

    def __init__(self, destination: Destination | None = None, *, idle_cap: int,
                 buffer_mode: Callable[[StorageRecycler], BufferMode] | None = None) -> None:
        super().__init__(destination)
        self.recycler = StorageRecycler(idle_cap=idle_cap)
        self._mode = buffer_mode(self.recycler) if buffer_mode is not None else None

    @property
    def sink(self) -> Sink:
        return self.recycler

    @property
    def held_bytes(self) -> int:
        return self.recycler.idle_cap

    def take_old_buffers(self, tensors: Iterable[torch.Tensor]) -> int:
        taken = super().take_old_buffers(tensors)
        if self._mode is None:  # nothing will carve them: held memory would only add up
            self.recycler.drop_group(BUFFER_GROUP)
        return taken

    def buffer_mode(self) -> BufferMode | None:
        return self._mode

    def adopt_buffers(self, buffers: Iterable[tuple[torch.Tensor, bool]]) -> None:
        # the old buffers' pages go into them, as into a buffer built here that no held storage fits
        for buffer, written in buffers:
            self.recycler.fill(buffer, BUFFER_GROUP)
            if self._mode is not None:
                self._mode.adopt(buffer, written_later=written)

    def buffers_built(self) -> None:
        # what is left of the old buffers goes; what old state the engine frees beyond the idle
        # cap is held for the new buffers left untouched (counted in the memory bound already)
        self.recycler.drop_group(BUFFER_GROUP)
        if self._mode is not None:
            self.recycler.reserve(self._mode.untouched_bytes)

    def allocate(self, key: StoreKey, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.destination.can_rebind(key):  # an old storage the engine is done with
            carved = self.recycler.take(key, numel, dtype, state_group(key[1]))
            if carved is not None and self.destination.rebind(key, carved):
                return carved
        tensor = super().allocate(key, numel, dtype, device)
        self.recycler.fill(tensor)  # the engine writes all of it: touched pages instead of fresh ones
        return tensor

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, last_read: bool) -> int:
        moved = self.recycler.copy_by_pages(dst, src) if last_read else None
        if moved is None:
            dst.copy_(src)
        return moved or 0

    def staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buffer = super().staging(nbytes, device)
        self.recycler.fill(buffer)
        return buffer

    def unstage(self, buffer: torch.Tensor) -> None:
        self.recycler.give_pages(buffer)

    def finish(self) -> None:
        if self._mode is not None:  # buffers left untouched get their memory now, not in the next step
            self._mode.fault_in_untouched()
        self.recycler.close(self.destination.rebind)

    def figures(self) -> MemoryFigures:
        plain = super().figures()
        return MemoryFigures(freed_bytes=plain.freed_bytes,
                             recycled_bytes=self.recycler.reused_bytes + self.recycler.moved_in_bytes,
                             moved_page_bytes=self.recycler.moved_in_bytes,
                             skipped_copy_bytes=self._mode.skipped_copy_bytes if self._mode is not None else 0)


__all__ = ["RecyclingMemory"]
