"""Storages taken out of a device's memory while a phase runs (a rollout), and given back after it.

A rollout parks what training needs again only after it (``megatron/rollout.py``): the optimizer's
state (main params, moments) goes to host memory, the gradient buffers (nothing in them between
two steps) and, without ``keep_weights``, the training shards of the weights (the rollout's own
copy refills them) are dropped. Parking works on whole storages, so every view into one (a
parameter in megatron's flat buffer, a distributed optimizer's shard) sees the memory again after
``restore``, where it was.

- ``ParkedStorages.drop(tensors)``: the storages' memory is freed; ``restore`` gives it back zeroed
  (the caller fills what it needs).
- ``ParkedStorages.to_host(tensors, copier)``: copied into host buffers first (``copier``: the
  device kind's ``host_copier``, pinned buffers on CUDA), then freed; ``restore`` copies them back.

Whether a device's memory can go to the host at all is the device kind's to say
(``DeviceKind.memory_is_host``): on CPU processes it is host memory already, and nothing moves.

Example::

    parked = ParkedStorages.to_host(optimizer_tensors, device_kind(device).host_copier())
    ...                      # the device memory is free meanwhile
    parked.restore()         # every tensor as it was, bit for bit
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A ``uint8`` tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def unique_storages(tensors: Iterable[torch.Tensor], *, leaving_out: Iterable[torch.Tensor] = ()
                    ) -> list[torch.UntypedStorage]:
    """The storages of ``tensors`` (each once, those with memory that can be resized), less those of
    ``leaving_out``."""
    skip = {t.untyped_storage().data_ptr() for t in leaving_out}
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip and ptr not in found and storage.nbytes() and storage.resizable():
            found[ptr] = storage
    return list(found.values())


class ParkedStorages:
    """Storages out of their device's memory until ``restore`` (see the module docstring)."""

    def __init__(self, storages: list[torch.UntypedStorage], host: list[torch.Tensor] | None) -> None:
        self._storages = [(s, s.nbytes()) for s in storages]
        self._host = host
        self.bytes = sum(n for _, n in self._storages)
        """Device bytes parked (freed until ``restore``)."""
        for storage in storages:
            storage.resize_(0)

    @classmethod
    def drop(cls, storages: list[torch.UntypedStorage]) -> "ParkedStorages":
        """Free ``storages``; ``restore`` gives them back zeroed."""
        return cls(storages, None)

    @classmethod
    def to_host(cls, storages: list[torch.UntypedStorage], copier) -> "ParkedStorages":
        """Copy ``storages`` into host buffers made by ``copier`` (``host_buffer(like)``), then free them."""
        host = []
        for storage in storages:
            view = _byte_view(storage)
            buffer = copier.host_buffer(view)
            buffer.copy_(view)
            host.append(buffer)
        return cls(storages, host)

    @property
    def on_host(self) -> bool:
        """Whether the contents wait in host memory (``to_host``), or were dropped."""
        return self._host is not None

    def restore(self) -> None:
        """Every storage back on its device at its size: its contents copied back, or zeroed."""
        for i, (storage, nbytes) in enumerate(self._storages):
            storage.resize_(nbytes)
            view = _byte_view(storage)
            if self._host is not None:
                view.copy_(self._host[i])
            else:
                view.zero_()
        self._storages, self._host = [], None


__all__ = ["ParkedStorages", "unique_storages"]
