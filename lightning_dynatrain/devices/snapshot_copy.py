"""Copies of device state into host buffers, made beside training (the in-memory snapshots'
first half, ``megatron/snapshot.py``), chosen by ``DeviceKind.host_copier``.

The snapshot's thread copies a rank's state while the main thread runs the next step's forward and
backward; the next update waits for the copy. ``mark`` (main thread, at the step boundary) records
what the copy must come after; ``copy`` (the snapshot's thread) makes it and returns once it is done.

- ``PlainHostCopier`` (the host, and accelerators without streams here): ``copy_`` on the calling
  thread; on the CPU nothing runs asynchronously, so the state the boundary left is what it reads;
- ``StreamHostCopier`` (CUDA): the copies run on a side stream of their own, after an event the
  training stream recorded at the boundary, into pinned host buffers (``non_blocking``), so they
  overlap the next step's kernels instead of queueing behind them on the training stream.

Example::

    copier = device_kind(device).host_copier()
    buffer = copier.host_buffer(param)
    copier.mark()                   # main thread, after the optimizer step was enqueued
    copier.copy([(buffer, param)])  # snapshot thread: returns when the copy is complete
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class PlainHostCopier:
    """Copies on the calling thread (see the module docstring)."""

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu")

    def mark(self) -> None:
        """Nothing to record: a copy on the host reads the state as the boundary left it."""

    def copy(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for host, tensor in pairs:
            host.copy_(tensor)


class StreamHostCopier:
    """Copies on a CUDA side stream into pinned buffers (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._ready: torch.cuda.Event | None = None

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)

    def mark(self) -> None:
        """Record the training stream's position: the copies start after the optimizer step."""
        self._ready = torch.cuda.Event()
        self._ready.record(torch.cuda.current_stream(self.device))

    def copy(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        assert self._ready is not None, "mark() at the boundary first"
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(self._ready)
            for host, tensor in pairs:  # (the state's tensors live on: no record_stream needed)
                host.copy_(tensor, non_blocking=True)
        self._stream.synchronize()


HostCopier = PlainHostCopier | StreamHostCopier

__all__ = ["HostCopier", "PlainHostCopier", "StreamHostCopier"]
