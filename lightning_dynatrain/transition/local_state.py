"""A rank's local state as the engine sees it: one torch tensor per local tensor, and views of boxes.

Keys are ``(tensor, kind, stack)``: the logical tensor's name, the state kind, and the *global* index
on its stack axes (``()`` without stack axes, ``(layer,)``, or ``(layer, expert)``). A value is

- for a grid region (``region.flat is None``): the whole local tensor, any physical shape, with
  ``numel == prod(view_shape)`` (vocabulary padding rows included; they are don't-care);
- for a zero1 region: the rank's 1-D shard, the flat range ``region.flat`` of the local tensor's
  row-major view. Several zero1 regions of one local tensor share that shard.

Example: ``linear_fc2.weight`` ``[layers=4, hidden=8, ffn=16]`` at ``dp2-tp2-pp2``, rank 5 holds the grid
region ``box=[2:4, 0:8, 8:16]``, ``origin=(2, 0, 8)``, ``view_shape=(8, 8)``: two local tensors, keys
``(name, kind, (2,))`` and ``(name, kind, (3,))``; the box ``[3:4, 0:8, 12:16]`` is
``store[(name, kind, (3,))].view(8, 8)[0:8, 4:8]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, MutableMapping, Sequence

import torch

from lightning_dynatrain.transition.errors import EngineInternalError, StateStoreError
from lightning_dynatrain.vps.box import Box, iter_cells
from lightning_dynatrain.vps.mapping import DTYPE_SIZES, Region
from lightning_dynatrain.vps.spec import StateKind

StoreKey = tuple[str, StateKind, tuple[int, ...]]
LocalStore = MutableMapping[StoreKey, torch.Tensor]
RegionMap = Mapping[tuple[str, StateKind], Sequence[Region]]


def stack_axes(region: Region) -> int:
    """Number of leading logical axes that index separate local tensors."""
    return len(region.origin) - len(region.view_shape)


def local_numel(region: Region) -> int:
    """Elements of the local tensor (grid) or of the 1-D shard (zero1) holding ``region``."""
    if region.flat is None:
        return math.prod(region.view_shape)
    return region.flat[1] - region.flat[0]


def stack_indices(box: Box, n_stack: int) -> Iterator[tuple[int, ...]]:
    """The global stack indices a box covers, in row-major order (the order boxes are packed in)."""
    return iter_cells([range(box.lo[a], box.hi[a]) for a in range(n_stack)])


def with_stack(box: Box, stack: tuple[int, ...]) -> Box:
    """``box`` restricted to the one local tensor at ``stack``."""
    n = len(stack)
    return Box(stack + box.lo[n:], tuple(s + 1 for s in stack) + box.hi[n:])


def box_view(local: torch.Tensor, region: Region, box: Box) -> torch.Tensor:
    """A writable view of ``box`` (inside one local tensor of ``region``) in that local tensor.

    The view has shape ``box.shape[stack_axes:]``. Writing to it writes the local tensor.
    """
    n = stack_axes(region)
    if region.flat is None:
        whole = local.view(region.view_shape)
        return whole[Box(box.lo[n:], box.hi[n:]).relative_to(region.origin[n:])]
    start = region.shard_offset()
    inner = local[start:start + region.box.numel].view(region.box.shape[n:])
    return inner[Box(box.lo[n:], box.hi[n:]).relative_to(region.box.lo[n:])]


def box_pieces(tensor: str, kind: StateKind, region: Region, box: Box) -> Iterator[tuple[StoreKey, Box]]:
    """``box`` cut per local tensor: ``(key, sub-box)`` in row-major order of the stack axes."""
    n = stack_axes(region)
    if n == 0:
        yield (tensor, kind, ()), box
        return
    for stack in stack_indices(box, n):
        yield (tensor, kind, stack), with_stack(box, stack)


class RegionIndex:
    """Finds the region of a rank that contains a box, and lists the rank's local tensors.

    Zero1 regions are indexed by their stack index (a rank has up to three per local tensor and
    thousands in all at scale); grid regions (one per tensor and kind) are scanned.
    """

    def __init__(self, regions: RegionMap) -> None:
        self._by_stack: dict[tuple, list[Region]] = {}
        self._by_tensor: dict[tuple[str, StateKind], list[Region]] = {}
        self._locals: dict[StoreKey, Region] = {}
        self._n_stack: dict[tuple[str, StateKind], int] = {}
        self._dtypes: dict[tuple[str, StateKind], str] = {}
        for (tensor, kind), lst in regions.items():
            for region in lst:
                self._dtypes.setdefault((tensor, kind), region.dtype)
                n = self._n_stack.setdefault((tensor, kind), stack_axes(region))
                if region.flat is not None:
                    stack = region.box.lo[:n]
                    self._by_stack.setdefault((tensor, kind, stack), []).append(region)
                    key = (tensor, kind, stack)
                    known = self._locals.setdefault(key, region)
                    assert known.flat == region.flat, f"{key}: one local tensor with two shard ranges"
                else:
                    self._by_tensor.setdefault((tensor, kind), []).append(region)
                    for stack in stack_indices(region.box, n):
                        self._locals[(tensor, kind, stack)] = region

    def find(self, tensor: str, kind: StateKind, box: Box) -> Region:
        """The region containing ``box``. Raises ``EngineInternalError`` if there is none."""
        for region in self._by_tensor.get((tensor, kind), ()):
            if region.box.contains(box):
                return region
        n = self._n_stack.get((tensor, kind))
        if n is not None:
            for region in self._by_stack.get((tensor, kind, box.lo[:n]), ()):
                if region.box.contains(box):
                    return region
        raise EngineInternalError(
            f"no region of {tensor}:{kind.value} contains box {box}; the plan and the regions passed to "
            "the engine were computed for different layouts, ranks or models"
        )

    def dtype_name(self, tensor: str, kind: StateKind) -> str | None:
        """The dtype (name) ``tensor``'s ``kind`` is stored in, or ``None`` when the rank holds none of it."""
        return self._dtypes.get((tensor, kind))

    def itemsize(self, tensor: str, kind: StateKind) -> int | None:
        """Bytes per element of ``tensor``'s ``kind``, or ``None`` when the rank holds none of it."""
        name = self._dtypes.get((tensor, kind))
        return None if name is None else DTYPE_SIZES[name]

    def local_tensors(self) -> dict[StoreKey, Region]:
        """Every local tensor of the rank, with one region that lives in it (for its size)."""
        return dict(self._locals)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a region's ``dtype`` names (``"bfloat16"`` -> ``torch.bfloat16``)."""
    return getattr(torch, name)


def check_local(key: StoreKey, tensor: torch.Tensor, region: Region, *, where: str) -> None:
    """Raise ``StateStoreError`` if ``tensor`` cannot hold ``region``'s local tensor."""
    want = local_numel(region)
    if tensor.numel() != want or not tensor.is_contiguous():
        kind = "1-D zero1 shard" if region.flat is not None else f"local tensor viewed as {region.view_shape}"
        raise StateStoreError(
            f"{where} {key[0]}:{key[1].value} stack {key[2]} has {tensor.numel()} elements "
            f"(contiguous={tensor.is_contiguous()}); the {kind} needs {want} contiguous elements",
            hint="hand the engine the local tensors (or shards) of the layout its regions were computed for",
        )


__all__ = [
    "LocalStore",
    "RegionIndex",
    "RegionMap",
    "StoreKey",
    "box_pieces",
    "box_view",
    "check_local",
    "local_numel",
    "stack_axes",
    "stack_indices",
    "torch_dtype",
    "with_stack",
]
