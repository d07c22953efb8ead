"""Giving an old state's memory back during a switch, as the engine finishes with it.

The objects that held the old state (a megatron model and optimizer) keep their tensors until the
switch returns, so dropping the engine's reference to a source tensor frees nothing.
``OldStorage`` frees the storage itself, through a ``Sink``: the OS (``ReturnToOS``) or the
host's ``StorageRecycler`` that carves new state out of it (``devices.host.recycler``):

- a storage once the engine has released every local tensor that lives in it: a tensor alone, a
  zero1 model's flat param buffer once every param view in it is done. Tensors the new state
  keeps in place are never released by the engine, so never freed here;
- a storage the new state keeps part of (a tensor kept in place that shares its storage with
  others, or a slice of an old tensor kept in place, ``kept``): the memory of every other tensor in
  it, and of the parts of the sliced tensor outside its slice, as the engine releases them, by
  ranges (the OS takes them back by their pages, where the memory's device kind can:
  ``devices.DeviceKind.release_pages``).

Every ``Sink`` sorts what it is given into groups: ``state_group`` of a state kind, and
``BUFFER_GROUP`` for the old gradient buffers a rebuild replaces.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.transition.program import StoreKey

#: the group of old gradient buffers held for the new model's DDP buffers (the host's ``CarveBuffers``)
BUFFER_GROUP = "buffer"


def state_group(kind) -> str:
    """The group of a state kind: params (and fp32 main params) or the optimizer's moments."""
    return "moment" if kind.is_optimizer_state else "param"


def free_storage(storage: torch.UntypedStorage) -> None:
    """Give the memory back now (the old state's tensors that still view it are never read again).
    A storage that cannot be resized (memory mapped from a file, or borrowed from another library)
    is left to its owner: it goes with its last reference."""
    if storage.resizable():
        storage.resize_(0)


class Sink(Protocol):
    """Where old memory goes: ``StorageRecycler`` (to be carved into new state) or ``ReturnToOS``."""

    def give(self, storage: torch.UntypedStorage, group: str, *, hold: bool = False) -> None: ...

    def give_range(self, storage: torch.UntypedStorage, start: int, end: int, group: str) -> int: ...


class ReturnToOS:
    """A ``Sink`` that hands old memory straight back: storages freed, ranges by their pages."""

    def give(self, storage: torch.UntypedStorage, group: str, *, hold: bool = False) -> None:
        free_storage(storage)

    def give_range(self, storage: torch.UntypedStorage, start: int, end: int, group: str) -> int:
        return device_kind(storage.device).release_pages(storage.data_ptr() + start, storage.data_ptr() + end)


class OldStorage:
    """Frees the old state of one switch as the engine releases it (see the module docstring)."""

    def __init__(self, store: Mapping[StoreKey, torch.Tensor], sink: Sink) -> None:
        self._sink = sink
        self._pending: dict[int, set[StoreKey]] = {}
        self._storages: dict[int, torch.UntypedStorage] = {}
        for key, tensor in store.items():
            storage = tensor.untyped_storage()
            self._pending.setdefault(storage.data_ptr(), set()).add(key)
            self._storages[storage.data_ptr()] = storage
        self._kept: set[int] = set()  # storages the new state keeps part of (``kept``)
        self._waiting: dict[int, list[tuple[StoreKey, torch.Tensor]]] = {}  # released, storage still in use
        self.freed_bytes = 0
        devices = {s.device for s in self._storages.values()}
        self.gives_pages_back = all(device_kind(d).gives_pages_back for d in devices)
        """Whether the rest of a partly kept storage can be given back (each storage's device kind
        says: the host's memory on Linux): only then may a view into a shared storage, or a slice of
        an old tensor, be kept in place."""

    def kept(self, key: StoreKey, tensor: torch.Tensor) -> None:
        """``tensor`` (a view into a storage shared with other old tensors, or a slice of an old
        tensor) is kept in place: its storage stays, and the rest of it goes back as released."""
        ptr = tensor.untyped_storage().data_ptr()
        self._pending[ptr].discard(key)
        self._kept.add(ptr)
        for released_key, released in self._waiting.pop(ptr, []):
            self._give_back(released_key, released)

    def release(self, key: StoreKey, tensor: torch.Tensor) -> None:
        """The engine no longer reads ``tensor`` (old local tensor ``key``, or a part of it)."""
        ptr = tensor.untyped_storage().data_ptr()
        pending = self._pending[ptr]
        pending.discard(key)
        if ptr in self._kept:
            self._give_back(key, tensor)
        elif pending:
            self._waiting.setdefault(ptr, []).append((key, tensor))
        else:
            self._waiting.pop(ptr, None)
            storage = self._storages.pop(ptr)
            self.freed_bytes += storage.nbytes()
            self._sink.give(storage, state_group(key[1]))

    def _give_back(self, key: StoreKey, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        offset = tensor.data_ptr() - storage.data_ptr()
        self.freed_bytes += tensor.nbytes
        self._sink.give_range(storage, offset, offset + tensor.nbytes, state_group(key[1]))


__all__ = ["BUFFER_GROUP", "OldStorage", "ReturnToOS", "Sink", "free_storage", "state_group"]
