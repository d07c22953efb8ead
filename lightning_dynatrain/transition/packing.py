"""Moving boxes between local tensors and byte buffers: pack, unpack, local copy, and the arena.

A pack buffer is raw ``uint8``; a box sits at a byte offset, viewed as its own dtype and its own
shape (stack axes included, row-major), so one buffer carries bf16 params and fp32 moments side by
side. Packing a box that spans several local tensors (several layers) writes one slab per local
tensor, in the order of the stack indices, which is the box's row-major order.

Each function takes the store key's tensor through a callable, so the engine can allocate a
destination tensor at its first write and count the last read of a source tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from lightning_dynatrain.transition.report import SwitchRecorder
from lightning_dynatrain.transition.local_state import StoreKey, box_pieces, box_view, stack_axes
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.mapping import Region
from lightning_dynatrain.vps.spec import StateKind

TensorOf = Callable[[StoreKey], torch.Tensor]


def buffer_view(buf: torch.Tensor, offset: int, box: Box, dtype: torch.dtype) -> torch.Tensor:
    """The bytes ``[offset, offset + box bytes)`` of a ``uint8`` buffer, as ``dtype`` in ``box.shape``."""
    nbytes = box.numel * dtype.itemsize
    return buf[offset:offset + nbytes].view(dtype).view(box.shape)


def _slab(packed: torch.Tensor, outer: Box, sub: Box, n_stack: int) -> torch.Tensor:
    """The part of ``packed`` (shaped like ``outer``) that holds ``sub``, one local tensor of it."""
    if n_stack == 0:
        return packed
    return packed[tuple(s - o for s, o in zip(sub.lo[:n_stack], outer.lo[:n_stack]))]


def pack_box(source: TensorOf, region: Region, tensor: str, kind: StateKind, box: Box, packed: torch.Tensor) -> None:
    """Copy ``box`` from the local tensors of ``region`` into ``packed`` (shaped ``box.shape``)."""
    n = stack_axes(region)
    for key, sub in box_pieces(tensor, kind, region, box):
        _slab(packed, box, sub, n).copy_(box_view(source(key), region, sub))


def unpack_box(dest: TensorOf, region: Region, tensor: str, kind: StateKind, box: Box, packed: torch.Tensor) -> None:
    """Copy ``packed`` (shaped ``box.shape``) into the local tensors of ``region``."""
    n = stack_axes(region)
    for key, sub in box_pieces(tensor, kind, region, box):
        box_view(dest(key), region, sub).copy_(_slab(packed, box, sub, n))


class StagingPages(Protocol):
    """Where a staging buffer's memory comes from and goes back to (the host's ``StorageRecycler``, ``devices.host``)."""

    def fill(self, tensor: torch.Tensor) -> int:
        """Back ``tensor`` (just allocated, written before it is read) by memory already touched."""

    def give_pages(self, tensor: torch.Tensor) -> None:
        """Take over ``tensor`` (alone in its storage), which the switch is done with."""


class StagingArena:
    """One ``uint8`` buffer reused by every stage of a switch, sized for the largest stage.

    Allocated at the first stage and released after the last; its bytes are what the report's
    ``peak_staging_bytes`` measures (the recorder sees every allocation and release). With
    ``pages``, the buffer is backed by their memory when allocated and handed to them when released.
    """

    def __init__(self, capacity: int, device: torch.device, recorder: SwitchRecorder,
                 pages: StagingPages | None = None) -> None:
        self.capacity = capacity
        self.device = device
        self._recorder = recorder
        self._pages = pages
        self._buf: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self._buf is None:
            self._buf = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
            if self._pages is not None:
                self._pages.fill(self._buf)
            self._recorder.staging_alloc(self._buf.numel())
        return self._buf

    def release(self) -> None:
        if self._buf is not None:
            self._recorder.staging_free(self._buf.numel())
            if self._pages is not None:
                self._pages.give_pages(self._buf)
            self._buf = None


__all__ = ["StagingArena", "StagingPages", "buffer_view", "pack_box", "unpack_box"]
