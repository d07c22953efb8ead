"""The memory policy of a switch: where new state's memory comes from and where old state's goes.

The engine's walker asks one object, chosen once per switch by the device's kind
(``devices.device_kind(device).switch_memory``):

- ``start(source)``: the old state, once every rank agreed to go on (nothing is freed before);
- ``allocate(key, numel, dtype, device)``: a destination local tensor, at its first write: the
  destination's own tensor (a megatron model built for the new layout) or a new one;
- ``keep(key, tensor, span)``: make a source tensor, or the contiguous run ``span`` of it, the
  destination of ``key`` (no copy), or decline (``None``) and the walker copies;
- ``release(key, tensor)``: the switch no longer reads a source tensor;
- ``copy(dst, src, last_read=...)``: copy a retained box;
- ``staging(nbytes, device)`` / ``unstage(buffer)``: the stage buffer;
- ``finish()``: the end of the switch.

``PlainMemory`` is every accelerator's policy (the caching allocator reuses what is freed) and
works on any CPU: new tensors are allocated, old storages freed as soon as their last tensor is
read, whole tensors that own their storage kept in place. The host's ``RecyclingMemory``
(``devices.host.recycling_memory``) is a ``PlainMemory`` that writes new state into old memory instead.
Each also serves a rebuild that replaces old buffers (megatron's gradient buffers,
``take_old_buffers``) and builds new ones (``buffer_mode``) between the plan and the engine.
``KeepOldMemory`` (``switch_safety="keep_old"``, any device) holds the old state until the switch
is confirmed.

Example (an engine-only switch)::

    new_store, report = execute_switch(program, store, PlainMemory())
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from lightning_dynatrain.transition.adoption import owns_storage
from lightning_dynatrain.transition.program import StoreKey
from lightning_dynatrain.devices.old_storage import BUFFER_GROUP, OldStorage, ReturnToOS, Sink


class Destination(Protocol):
    """The new state's side: its tensors where they exist already, and whether a key can be pointed
    at another tensor (a megatron model's parameter or optimizer state: ``state_bridge.MegatronTarget``)."""

    def tensor(self, key: StoreKey) -> torch.Tensor | None: ...

    def can_rebind(self, key: StoreKey) -> bool: ...

    def rebind(self, key: StoreKey, tensor: torch.Tensor) -> bool: ...


class FreshDestination:
    """No destination objects: every new tensor is allocated, and any can be a kept old tensor."""

    def tensor(self, key: StoreKey) -> torch.Tensor | None:
        return None

    def can_rebind(self, key: StoreKey) -> bool:
        return True

    def rebind(self, key: StoreKey, tensor: torch.Tensor) -> bool:
        return True


class BufferMode(Protocol):
    """A torch-function mode under which library code builds new buffers into old memory
    (the host's ``devices.host.carve_buffers.CarveBuffers``)."""

    skipped_copy_bytes: int

    @property
    def untouched_bytes(self) -> int: ...

    def fault_in_untouched(self) -> int: ...

    def adopt(self, buffer: torch.Tensor, *, written_later: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    """What a switch's policy did with memory, on one rank.

    Attributes:
        freed_bytes: old state given away (old buffers, then each storage the engine was done with).
        recycled_bytes: new state written into old memory (carved, or backed by moved pages).
        moved_page_bytes: of those, old pages moved into new tensors.
        skipped_copy_bytes: library copies into new buffers skipped (the engine writes them).
    """

    freed_bytes: int = 0
    recycled_bytes: int = 0
    moved_page_bytes: int = 0
    skipped_copy_bytes: int = 0


class PlainMemory:
    """Allocate, free, keep what owns its storage (see the module docstring). One per switch."""

    def __init__(self, destination: Destination | None = None) -> None:
        self.destination: Destination = destination if destination is not None else FreshDestination()
        self.old: OldStorage | None = None
        self._old_buffers: list[tuple[torch.UntypedStorage, torch.Tensor, int]] = []
        self._kept: dict[StoreKey, tuple[int, int] | None] = {}

    @property
    def sink(self) -> Sink:
        return ReturnToOS()

    @property
    def started(self) -> bool:
        """Whether the engine began (old state may be partly gone: it cannot be restored)."""
        return self.old is not None

    @property
    def held_bytes(self) -> int:
        """Old memory the policy may hold beyond what the plan frees (for the memory bound)."""
        return 0

    # ------------------------------------------------------------------------------ the rebuild
    def take_old_buffers(self, tensors: Iterable[torch.Tensor]) -> int:
        """Old buffers the rebuild replaces by as much (gradient buffers): freed now, or held for
        the new buffers (the host's ``RecyclingMemory``). Their bytes."""
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self._old_buffers.append((storage, tensor, storage.nbytes()))
            self.sink.give(storage, BUFFER_GROUP, hold=True)
            total += tensor.nbytes
        return total

    def restore_old_buffers(self) -> None:
        """Give the old buffers their memory back (zeroed): only before the engine started."""
        assert not self.started, "the old state is partly freed: it cannot be restored"
        for storage, tensor, nbytes in self._old_buffers:
            if storage.nbytes() != nbytes:  # freed (a new buffer may view it: garbage now)
                storage.resize_(nbytes)
            tensor.zero_()
        self._old_buffers.clear()

    def buffer_mode(self) -> BufferMode | None:
        """The mode to build the new buffers under (``None``: as the library allocates them)."""
        return None

    def buffers_built(self) -> None:
        """The new buffers exist; the engine comes next."""

    def adopt_buffers(self, buffers: Iterable[tuple[torch.Tensor, bool]]) -> None:
        """New buffers built ahead and given fresh memory inside the switch (``megatron.ahead``),
        as ``(buffer, the engine writes every element)``; call ``buffers_built`` next."""

    def bind(self, destination: Destination) -> None:
        """The new state, once built."""
        self.destination = destination

    # ------------------------------------------------------------------------------ the engine
    def start(self, source: dict[StoreKey, torch.Tensor]) -> None:
        self.old = OldStorage(source, self.sink)

    def allocate(self, key: StoreKey, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = self.destination.tensor(key)
        return tensor if tensor is not None else torch.empty(numel, dtype=dtype, device=device)

    def keep(self, key: StoreKey, tensor: torch.Tensor, span: tuple[int, int] | None) -> torch.Tensor | None:
        """The destination of ``key`` made the old ``tensor`` (or its run ``span``), or ``None``.

        A view into a larger storage, or a slice, is kept only where the rest of that storage can
        be given back by its pages: keeping it would otherwise keep the whole old buffer alive.
        """
        assert self.old is not None, "start() first"
        if not self.destination.can_rebind(key):
            return None
        if span is not None or not owns_storage(tensor):
            if not (tensor.is_contiguous() and self.old.gives_pages_back):
                return None
        view = tensor if span is None else tensor.view(-1)[span[0]:span[1]]
        if not self.destination.rebind(key, view):
            return None
        if span is not None or not owns_storage(tensor):
            self.old.kept(key, view)
        self._kept[key] = span
        return view

    def release(self, key: StoreKey, tensor: torch.Tensor) -> None:
        assert self.old is not None, "start() first"
        if key not in self._kept:
            self.old.release(key, tensor)
            return
        span = self._kept[key]
        if span is not None:  # the parts of the old tensor around the slice kept in place
            flat = tensor.view(-1)
            for rest in (flat[:span[0]], flat[span[1]:]):
                if rest.numel():
                    self.old.release(key, rest)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, last_read: bool) -> int:
        """Copy ``src`` into ``dst``; the bytes that moved by their pages instead (0 here)."""
        dst.copy_(src)
        return 0

    def staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def unstage(self, buffer: torch.Tensor) -> None:
        """The walker is done with the stage buffer (it drops its reference after this)."""

    def finish(self) -> None:
        """The engine is done: anything the policy still holds goes where it belongs."""

    def figures(self) -> MemoryFigures:
        freed = sum(t.nbytes for _, t, _ in self._old_buffers) + (self.old.freed_bytes if self.old else 0)
        return MemoryFigures(freed_bytes=freed)


class _Held:
    """A ``Sink`` that frees nothing until told: what ``KeepOldMemory`` gives back waits here."""

    def __init__(self) -> None:
        self.storages: list[torch.UntypedStorage] = []

    def give(self, storage: torch.UntypedStorage, group: str, *, hold: bool = False) -> None:
        self.storages.append(storage)

    def give_range(self, storage: torch.UntypedStorage, start: int, end: int, group: str) -> int:
        raise AssertionError("KeepOldMemory keeps nothing in place: no range of an old storage is given back")


class KeepOldMemory(PlainMemory):
    """``switch_safety="keep_old"``: the old state stays whole until every rank confirmed its new
    state. Nothing is kept in place (the new state is all new memory, ``keep`` says no), and what
    the engine releases, the old gradient buffers included, is held: ``commit`` frees it after the
    switch is confirmed, ``rollback`` gives the old buffers back after a failure (the old model,
    DDP and optimizer then hold the state of before the switch, bit for bit)."""

    def __init__(self, destination: Destination | None = None) -> None:
        super().__init__(destination)
        self._held = _Held()

    @property
    def sink(self) -> Sink:
        return self._held

    def keep(self, key: StoreKey, tensor: torch.Tensor, span: tuple[int, int] | None) -> torch.Tensor | None:
        return None

    def commit(self) -> None:
        """Every rank holds its new state: free the old."""
        out = ReturnToOS()
        for storage in self._held.storages:
            out.give(storage, BUFFER_GROUP)
        self._held.storages.clear()

    def rollback(self) -> None:
        """The switch failed: the old state is whole; its gradient buffers are zeroed (as at a step's start)."""
        self._held.storages.clear()
        self.old = None  # nothing was freed: ``restore_old_buffers`` may run
        self.restore_old_buffers()


__all__ = ["BufferMode", "Destination", "FreshDestination", "KeepOldMemory", "MemoryFigures", "PlainMemory"]
