"""The host's device kind, and all the code that exists only for CPU processes.

``HostKind`` answers ``devices.DeviceKind`` for the CPU (and the storage-free ``meta`` device a
probe builds on). What it hands out lives beside it:

- ``recycling``: ``RecyclingMemory``, a switch's new state written into old memory, over
  ``recycler`` (``StorageRecycler``: new tensors carved out of old storages) and ``page_moves``
  (whole pages moved between address ranges, Linux);
- ``carve_buffers``: megatron's DDP buffers built into the old gradient buffers (``CarveBuffers``);
- ``megatron_patches``: megatron-core on CPU with gloo (``megatron_on_cpu``: one commented patch
  per CUDA assumption);
- ``meminfo``: the host's free memory, for the memory check.

Example::

    kind = HostKind()
    memory = kind.switch_memory(recycle=None, idle_cap=256 * 2**20, keep_old=False)  # RecyclingMemory
"""

from __future__ import annotations

import socket
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from lightning_dynatrain.devices.host.carve_buffers import switch_buffers
from lightning_dynatrain.devices.host.megatron_patches import megatron_on_cpu
from lightning_dynatrain.devices.host.meminfo import host_available_bytes
from lightning_dynatrain.devices.host.page_moves import can_move_pages, discard_pages
from lightning_dynatrain.devices.host.recycler import StorageRecycler
from lightning_dynatrain.devices.host.recycling_memory import RecyclingMemory
from lightning_dynatrain.devices.snapshot_copy import PlainHostCopier
from lightning_dynatrain.devices.memory_policy import KeepOldMemory, PlainMemory


@dataclass(frozen=True, slots=True)
class HostKind:
    """The host (CPU processes): see the package docstring and ``devices.DeviceKind``."""

    device: torch.device = torch.device("cpu")

    def switch_memory(self, *, recycle: bool | None = None, idle_cap: int, keep_old: bool = False) -> PlainMemory:
        """``KeepOldMemory`` with ``keep_old``; else ``RecyclingMemory`` (its DDP buffers carved out
        of the old gradient buffers) unless ``recycle=False``, which gets ``PlainMemory``."""
        if keep_old:
            return KeepOldMemory()
        if recycle is False:
            return PlainMemory()
        return RecyclingMemory(idle_cap=idle_cap, buffer_mode=switch_buffers)

    def unfilled_buffer_mode(self) -> TorchFunctionMode:
        """``CarveBuffers`` over an empty recycler: DDP's buffers built untouched (no page faulted in)
        and its copies of the uninitialised params skipped, so a build ahead of a switch never holds
        a second copy of the state."""
        return switch_buffers(StorageRecycler(idle_cap=0))

    def megatron_context(self, inner: TorchFunctionMode | None = None) -> AbstractContextManager[None]:
        """``megatron_on_cpu(inner)``: CUDA answered on CPU for the enclosed megatron calls."""
        return megatron_on_cpu(inner)

    @property
    def gives_pages_back(self) -> bool:
        """Linux: ``madvise`` hands whole pages back."""
        return can_move_pages()

    def release_pages(self, start: int, end: int) -> int:
        return discard_pages(start, end)

    def free_bytes(self) -> int | None:
        """The host's ``MemAvailable``: every rank of a host shares it."""
        return host_available_bytes()

    def pool_name(self) -> str:
        return socket.gethostname()

    def host_copier(self) -> PlainHostCopier:
        """Plain copies: the state is in host memory already."""
        return PlainHostCopier()

    @property
    def memory_is_host(self) -> bool:
        return True


__all__ = ["HostKind"]
