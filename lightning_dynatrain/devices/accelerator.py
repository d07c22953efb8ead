"""An accelerator's device kind: plain memory, megatron-core as it is.

``AcceleratorKind`` answers ``devices.DeviceKind`` for any device but the host. Its caching
allocator reuses freed blocks by itself, so a switch allocates and frees (``devices.memory_policy.PlainMemory``),
keeps nothing by ranges (no pages to give back), and megatron builds its buffers as it does;
megatron-core runs unpatched but for its Apex-free norm (patch D, ``devices/norm_patch.py``).
Memory figures come from ``torch.accelerator``, whatever the backend.

Example::

    kind = AcceleratorKind(torch.device("cuda", 0))
    memory = kind.switch_memory(recycle=None, idle_cap=0, keep_old=False)  # PlainMemory
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from lightning_dynatrain.devices.snapshot_copy import HostCopier, PlainHostCopier, StreamHostCopier
from lightning_dynatrain.devices.norm_patch import patch_torch_norm
from lightning_dynatrain.devices.memory_policy import KeepOldMemory, PlainMemory


@dataclass(frozen=True, slots=True)
class AcceleratorKind:
    """An accelerator: see the module docstring and ``devices.DeviceKind``."""

    device: torch.device

    def switch_memory(self, *, recycle: bool | None = None, idle_cap: int, keep_old: bool = False) -> PlainMemory:
        """``KeepOldMemory`` with ``keep_old``, else ``PlainMemory``; ``recycle`` and ``idle_cap``
        concern host memory only (the caching allocator reuses what a switch frees)."""
        return KeepOldMemory() if keep_old else PlainMemory()

    def unfilled_buffer_mode(self) -> None:
        """None: a build ahead of a switch holds the target shard's memory until it gives it back."""
        return None

    @contextlib.contextmanager
    def megatron_context(self, inner: TorchFunctionMode | None = None) -> Iterator[None]:
        """Megatron-core as it is (patch D applied), under ``inner`` if given."""
        patch_torch_norm()
        with inner if inner is not None else contextlib.nullcontext():
            yield

    @property
    def gives_pages_back(self) -> bool:
        return False

    def release_pages(self, start: int, end: int) -> int:
        return 0

    def free_bytes(self) -> int | None:
        """The device's free memory plus what this process's caching allocator holds unused;
        ``None`` where the backend does not say."""
        current = torch.accelerator.current_accelerator()
        if current is None or current.type != self.device.type:
            return None
        try:
            free, _ = torch.accelerator.get_memory_info(self.device)
            return free + torch.accelerator.memory_reserved(self.device) - torch.accelerator.memory_allocated(self.device)
        except (RuntimeError, NotImplementedError):
            return None

    def pool_name(self) -> str:
        """``host/type:index``: each device is one pool."""
        return f"{socket.gethostname()}/{self.device.type}:{self.device.index or 0}"

    def host_copier(self) -> HostCopier:
        """CUDA: copies on a side stream into pinned buffers; other accelerators: plain copies."""
        return StreamHostCopier(self.device) if self.device.type == "cuda" else PlainHostCopier()

    @property
    def memory_is_host(self) -> bool:
        return False


__all__ = ["AcceleratorKind"]
