"""What differs between the host (CPU processes) and an accelerator, chosen once from a device.

A switch, a build ahead of one, the memory check, the giving back of old memory and every entry
into megatron-core ask one ``DeviceKind`` (``device_kind(device)``) instead of testing
``device.type``:

- ``switch_memory(recycle=, idle_cap=, keep_old=)``: the memory policy of one switch
  (``devices.memory_policy.PlainMemory`` or a subclass);
- ``unfilled_buffer_mode()``: the torch-function mode a build ahead of a switch makes megatron's
  DDP buffers under, or ``None``;
- ``megatron_context(inner)``: the context megatron-core's calls run in (``inner``: another
  torch-function mode they also run under);
- ``gives_pages_back`` / ``release_pages(start, end)``: whether, and how, part of a storage's
  memory goes back to the system before the whole storage is freed;
- ``free_bytes()`` / ``pool_name()``: the memory pool a switch draws on (memory check);
- ``host_copier()``: how an in-memory snapshot copies the state into host buffers beside training
  (``snapshot_copy``);
- ``memory_is_host``: whether the device's memory is host memory already (a rollout's
  ``park="host"`` then moves nothing, ``parked_storage``).

Two kinds, frozen dataclasses over the device: ``host.HostKind`` for the CPU (and the storage-free
``meta`` device a probe builds on), whose package holds all the code that exists only for CPU
processes (page moves, the storage recycler and its policy, megatron's buffers carved out of old
storages, the megatron-core adapter for CPU), and ``accelerator.AcceleratorKind`` for any other
device (plain memory: its caching allocator reuses freed blocks). Each is imported only when a
device of its kind is asked about.

Example::

    kind = device_kind(next(model.parameters()).device)
    memory = kind.switch_memory(recycle=None, idle_cap=256 * 2**20, keep_old=False)
    with kind.megatron_context():
        ddp = DistributedDataParallel(...)
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from lightning_dynatrain.devices.snapshot_copy import HostCopier
    from lightning_dynatrain.devices.memory_policy import PlainMemory

#: device types the host's kind serves: the CPU, and ``meta`` (no memory, no accelerator runtime)
HOST_TYPES = ("cpu", "meta")


class DeviceKind(Protocol):
    """What a switch and megatron's calls need to know of a device (see the module docstring)."""

    @property
    def device(self) -> torch.device:
        """The device this kind was chosen from."""

    def switch_memory(self, *, recycle: bool | None = None, idle_cap: int, keep_old: bool = False) -> PlainMemory:
        """One switch's memory policy. ``recycle``: write new state into old memory (``None``: where
        the kind does by default); ``idle_cap``: bytes of old memory a recycling policy may hold
        idle; ``keep_old``: hold the old state until the switch is confirmed (``KeepOldMemory``)."""

    def unfilled_buffer_mode(self) -> TorchFunctionMode | None:
        """The mode a build ahead of a switch makes DDP's buffers under (``None``: as megatron does)."""

    def megatron_context(self, inner: TorchFunctionMode | None = None) -> AbstractContextManager[None]:
        """The context megatron-core's calls run in, under ``inner`` too where given."""

    @property
    def gives_pages_back(self) -> bool:
        """Whether ``release_pages`` can hand memory back (only then may part of a storage be kept)."""

    def release_pages(self, start: int, end: int) -> int:
        """Hand the whole pages between addresses ``start`` and ``end`` back to the system (memory
        nothing reads again); the bytes released, 0 where not possible."""

    def free_bytes(self) -> int | None:
        """Bytes a switch may still take from the device's pool, or ``None`` where unknown."""

    def pool_name(self) -> str:
        """Which pool the device draws on: ranks with the same name share its free memory."""

    def host_copier(self) -> HostCopier:
        """What copies this device's tensors into host buffers beside training (``snapshot_copy``)."""

    @property
    def memory_is_host(self) -> bool:
        """Whether the device's memory is the host's (nothing to gain by moving state to the host)."""


def device_kind(device: torch.device | str) -> DeviceKind:
    """The kind of ``device``: ``HostKind`` for the CPU and ``meta``, ``AcceleratorKind`` otherwise."""
    device = torch.device(device)
    if device.type in HOST_TYPES:
        from lightning_dynatrain.devices.host import HostKind

        return HostKind(device)
    from lightning_dynatrain.devices.accelerator import AcceleratorKind

    return AcceleratorKind(device)


__all__ = ["HOST_TYPES", "DeviceKind", "device_kind"]
