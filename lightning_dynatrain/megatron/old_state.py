"""Giving an old megatron state's memory back during a switch, as the engine finishes with it.

The old model and optimizer hold their tensors until the switch returns, so dropping the engine's
reference to a source tensor frees nothing. ``OldStateMemory`` frees the storage itself:

- the gradient buffers at once (between two optimizer steps they hold nothing the next step needs:
  it zeroes them first), before the new model's buffers are allocated;
- each storage of params, fp32 main params and Adam moments once the engine has released every
  local tensor that lives in it (``release``, the engine's callback): a zero0 tensor alone, a zero1
  model's flat param buffer once every param view in it is done. Tensors the new layout keeps in
  place are never released by the engine, so never freed here.

Until the engine releases its first tensor the old state is whole: ``restore_gradients`` undoes
the one change (the gradient buffers come back, zeroed) when a switch is refused before it moves
anything, so training can go on at the old layout.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_dynatrain.engine.store import StoreKey


class OldStateMemory:
    """Frees the old state of one switch (see the module docstring). One per switch."""

    def __init__(self, ddp: Any, store: dict[StoreKey, torch.Tensor]) -> None:
        self._pending: dict[int, set[StoreKey]] = {}
        self._storages: dict[int, torch.UntypedStorage] = {}
        for key, tensor in store.items():
            storage = tensor.untyped_storage()
            self._pending.setdefault(storage.data_ptr(), set()).add(key)
            self._storages[storage.data_ptr()] = storage
        self._grads = [(buf.grad_data.untyped_storage(), buf.grad_data)
                       for buf in [*ddp.buffers, *ddp.expert_parallel_buffers]]
        self._grad_bytes = [storage.nbytes() for storage, _ in self._grads]
        self.started = False
        self.freed_bytes = 0

    def free_gradients(self) -> None:
        for storage, _ in self._grads:
            self.freed_bytes += storage.nbytes()
            storage.resize_(0)

    def restore_gradients(self) -> None:
        """Give the gradient buffers their memory back (zeroed); only before anything was released."""
        assert not self.started, "the old state is partly freed: it cannot be restored"
        for (storage, data), nbytes in zip(self._grads, self._grad_bytes):
            storage.resize_(nbytes)
            data.zero_()
            self.freed_bytes -= nbytes

    def release(self, key: StoreKey, tensor: torch.Tensor) -> None:
        """The engine's ``release`` callback."""
        self.started = True
        ptr = tensor.untyped_storage().data_ptr()
        pending = self._pending[ptr]
        pending.discard(key)
        if not pending:
            storage = self._storages.pop(ptr)
            self.freed_bytes += storage.nbytes()
            storage.resize_(0)


__all__ = ["OldStateMemory"]
