"""Giving an old megatron state's memory back during a switch, as the engine finishes with it.

The old model and optimizer hold their tensors until the switch returns, so dropping the engine's
reference to a source tensor frees nothing. ``OldStateMemory`` frees the storage itself:

- the gradient buffers at once (between two optimizer steps they hold nothing the next step needs:
  it zeroes them first), before the new model's buffers are allocated;
- each storage of params, fp32 main params and Adam moments once the engine has released every
  local tensor that lives in it (``release``, the engine's callback): a zero0 tensor alone, a zero1
  model's flat param buffer once every param view in it is done. Tensors the new layout keeps in
  place are never released by the engine, so never freed here. With a ``StorageRecycler`` such a
  storage goes to it instead, and new state is carved out of it (CPU: no fresh pages to fault in).
- a storage the new state keeps part of (a tensor kept in place that shares its storage with
  others, ``kept``): the pages of every other tensor in it, as the engine releases them.

Until the engine releases its first tensor the old state is whole: ``restore_gradients`` undoes
the one change (the gradient buffers come back, zeroed) when a switch is refused before it moves
anything, so training can go on at the old layout.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_dynatrain.engine.recycling import (
    BUFFER_GROUP,
    StorageRecycler,
    can_release_pages,
    release_pages,
    state_group,
)
from lightning_dynatrain.engine.store import StoreKey


class OldStateMemory:
    """Frees the old state of one switch (see the module docstring). One per switch."""

    def __init__(self, ddp: Any, store: dict[StoreKey, torch.Tensor], recycler: StorageRecycler | None = None) -> None:
        self._recycler = recycler
        self._pending: dict[int, set[StoreKey]] = {}
        self._storages: dict[int, torch.UntypedStorage] = {}
        for key, tensor in store.items():
            storage = tensor.untyped_storage()
            self._pending.setdefault(storage.data_ptr(), set()).add(key)
            self._storages[storage.data_ptr()] = storage
        self._kept: set[int] = set()  # storages the new state keeps part of (``kept``)
        self._waiting: dict[int, list[torch.Tensor]] = {}  # released tensors of storages still in use
        self._grads = [(buf.grad_data.untyped_storage(), buf.grad_data)
                       for buf in [*ddp.buffers, *ddp.expert_parallel_buffers]]
        self._grad_bytes = [storage.nbytes() for storage, _ in self._grads]
        self.started = False
        self.freed_bytes = 0

    @property
    def gradient_bytes(self) -> int:
        """Bytes of the old gradient buffers (what ``free_gradients`` gives back)."""
        return sum(self._grad_bytes)

    def free_gradients(self) -> None:
        """Free the gradient buffers, or, with a recycler, hand them to it (``BUFFER_GROUP``) for the
        new model's DDP buffers to be carved from (``CarveBuffers``)."""
        for storage, _ in self._grads:
            self.freed_bytes += storage.nbytes()
            if self._recycler is not None:
                self._recycler.give(storage, BUFFER_GROUP, hold=True)
            else:
                storage.resize_(0)

    def restore_gradients(self) -> None:
        """Give the gradient buffers their memory back (zeroed); only before anything was released."""
        assert not self.started, "the old state is partly freed: it cannot be restored"
        for (storage, data), nbytes in zip(self._grads, self._grad_bytes):
            if storage.nbytes() != nbytes:  # freed (not recycled: a new buffer may view it, discarded now)
                storage.resize_(nbytes)
            data.zero_()
            self.freed_bytes -= nbytes

    @property
    def gives_pages_back(self) -> bool:
        """Whether ``kept`` can give back the rest of a partly kept storage (CPU memory on Linux)."""
        return can_release_pages() and all(s.device.type == "cpu" for s in self._storages.values())

    def kept(self, key: StoreKey, tensor: torch.Tensor) -> None:
        """``tensor`` (a view into a storage shared with other old tensors) is kept in place by the new
        state: the storage stays, and the pages of every other tensor in it are given back as the
        engine releases them (``release_pages``), so no part of it stays alive unused."""
        self.started = True
        ptr = tensor.untyped_storage().data_ptr()
        self._pending[ptr].discard(key)
        self._kept.add(ptr)
        for released in self._waiting.pop(ptr, []):
            self._give_pages(released)

    def _give_pages(self, tensor: torch.Tensor) -> None:
        start = tensor.data_ptr()
        self.freed_bytes += release_pages(tensor.device, start, start + tensor.nbytes)

    def release(self, key: StoreKey, tensor: torch.Tensor) -> None:
        """The engine's ``release`` callback."""
        self.started = True
        ptr = tensor.untyped_storage().data_ptr()
        pending = self._pending[ptr]
        pending.discard(key)
        if ptr in self._kept:
            self._give_pages(tensor)
        elif pending:
            self._waiting.setdefault(ptr, []).append(tensor)
        else:
            self._waiting.pop(ptr, None)
            storage = self._storages.pop(ptr)
            self.freed_bytes += storage.nbytes()
            if self._recycler is not None:
                self._recycler.give(storage, state_group(key[1]))
            else:
                storage.resize_(0)


__all__ = ["OldStateMemory"]
