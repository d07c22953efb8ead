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
  others, or a slice of an old tensor kept in place, ``kept``): the memory of every other tensor in
  it, and of the parts of the sliced tensor outside its slice, as the engine releases them; with a
  ``StorageRecycler`` as ranges new state is carved from (``give_range``), else by their pages.

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
    free_storage,
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
        self._waiting: dict[int, list[tuple[StoreKey, torch.Tensor]]] = {}  # released, storage still in use
        self._grads = [(buf.grad_data.untyped_storage(), buf.grad_data)
                       for buf in [*ddp.buffers, *ddp.expert_parallel_buffers]]
        self._grad_bytes = [storage.nbytes() for storage, _ in self._grads]  # to restore them
        self.started = False
        self.freed_bytes = 0

    @property
    def gradient_bytes(self) -> int:
        """Bytes of the old gradient buffers (what ``free_gradients`` gives back). A buffer a switch
        carved from a larger old storage lives in a longer storage whose tail it gave back to the
        OS (``StorageRecycler.take_whole``): that tail holds no memory, so it is not counted."""
        return sum(data.nbytes for _, data in self._grads)

    def free_gradients(self) -> None:
        """Free the gradient buffers, or, with a recycler, hand them to it (``BUFFER_GROUP``) for the
        new model's DDP buffers to be carved from (``CarveBuffers``)."""
        for storage, data in self._grads:
            self.freed_bytes += data.nbytes
            if self._recycler is not None:
                self._recycler.give(storage, BUFFER_GROUP, hold=True)
            else:
                free_storage(storage)

    def restore_gradients(self) -> None:
        """Give the gradient buffers their memory back (zeroed); only before anything was released."""
        assert not self.started, "the old state is partly freed: it cannot be restored"
        for (storage, data), nbytes in zip(self._grads, self._grad_bytes):
            if storage.nbytes() != nbytes:  # freed (not recycled: a new buffer may view it, discarded now)
                storage.resize_(nbytes)
            data.zero_()
            self.freed_bytes -= data.nbytes

    @property
    def gives_pages_back(self) -> bool:
        """Whether ``kept`` can give back the rest of a partly kept storage (CPU memory on Linux)."""
        return can_release_pages() and all(s.device.type == "cpu" for s in self._storages.values())

    def kept(self, key: StoreKey, tensor: torch.Tensor) -> None:
        """``tensor`` (a view into a storage shared with other old tensors, or a slice of an old
        tensor) is kept in place by the new state: the storage stays, and the memory of every other
        tensor in it (of the rest of the sliced one) is given back as the engine releases it, to the
        recycler as a range (``give_range``) or to the OS by its pages (``release_pages``), so no
        part of it stays alive unused."""
        self.started = True
        ptr = tensor.untyped_storage().data_ptr()
        self._pending[ptr].discard(key)
        self._kept.add(ptr)
        for released_key, released in self._waiting.pop(ptr, []):
            self._give_back(released_key, released)

    def _give_back(self, key: StoreKey, tensor: torch.Tensor) -> None:
        start = tensor.data_ptr()
        if self._recycler is None:
            self.freed_bytes += release_pages(tensor.device, start, start + tensor.nbytes)
            return
        storage = tensor.untyped_storage()
        offset = start - storage.data_ptr()
        self.freed_bytes += tensor.nbytes
        self._recycler.give_range(storage, offset, offset + tensor.nbytes, state_group(key[1]))

    def release(self, key: StoreKey, tensor: torch.Tensor) -> None:
        """The engine's ``release`` callback."""
        self.started = True
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
            if self._recycler is not None:
                self._recycler.give(storage, state_group(key[1]))
            else:
                free_storage(storage)


__all__ = ["OldStateMemory"]
