"""The mapping F_P(layout, rank): which boxes of which state a rank holds, and who holds a box.

Two ways a piece of state is distributed:

- ``GridState``: params always, optimizer state with ``zero0``. A rank holds one grid cell (see
  ``grid.py``) of every tensor its stage holds (one per model chunk with virtual stages), as whole
  local tensors.
- ``ZeroState``: optimizer state (fp32 main params, Adam moments) with ``zero1``. A rank holds the
  flat ranges its data-parallel shard covers in Megatron's buffer (see ``zero_buffer.py``); each
  range of one local tensor is cut by ``decompose_flat`` into boxes that are contiguous in it.

Both answer the same two questions, which is all the planner needs:

- ``regions(rank)``: the ``Region`` list a rank holds (disjoint boxes, with where they live locally);
- ``pieces(box)``: the *atoms* that overlap a box, each with the sorted tuple of ranks holding it.
  A rank holds every atom it touches whole, which is what makes "retain if you hold it" exact.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Iterator, NamedTuple

from lightning_dynatrain.vps.box import Box, decompose_flat, ravel
from lightning_dynatrain.vps.grid import Cell, GridPlacement, grid_placement
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind
from lightning_dynatrain.vps.zero_buffer import ShardBuffer, buffer_group, param_dtype_of, shard_buffer

Piece = tuple[Box, tuple[int, ...]]

#: bytes per element of the dtypes state is stored in (``Region.dtype``)
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


class Region(NamedTuple):
    """A box a rank holds, and where it lives in the rank's local storage.

    ``origin`` is the logical coordinate (all axes) of element 0 of the local tensor; on stack axes it
    is the first local layer/expert. ``view_shape`` is one local tensor viewed on the non-stack
    logical axes, padding included. ``flat`` is ``None`` for whole local tensors; for a zero1 shard it
    is the ``[start, stop)`` of the local tensor's row-major flattening that the rank's 1-D shard
    covers (the box is then inside one local tensor and contiguous in it). ``dtype`` names the torch
    dtype the state is stored in (``"float32"``, ``"bfloat16"``).
    """

    box: Box
    origin: tuple[int, ...]
    view_shape: tuple[int, ...]
    flat: tuple[int, int] | None
    dtype: str = "float32"

    @property
    def itemsize(self) -> int:
        """Bytes per element of the state this region holds."""
        return DTYPE_SIZES[self.dtype]

    def shard_offset(self) -> int:
        """For a zero1 region: offset of the box's first element in the rank's 1-D shard."""
        assert self.flat is not None
        stack = len(self.origin) - len(self.view_shape)
        local = tuple(l - o for l, o in zip(self.box.lo[stack:], self.origin[stack:]))
        return ravel(local, self.view_shape) - self.flat[0]


class GridState:
    """State distributed as whole local tensors (a grid cell per rank and model chunk)."""

    def __init__(self, grid: GridPlacement) -> None:
        self.grid = grid

    def regions(self, rank: int) -> list[Region]:
        out = []
        stack = self.grid.tensor.stack_axes
        for cell in self.grid.cells_of(rank):
            box = self.grid.cell_box(cell)
            if box is not None:
                out.append(Region(box, box.lo[:stack] + self.grid.local_origin(cell), self.grid.local_shape(), None))
        return out

    def pieces(self, box: Box) -> Iterator[Piece]:
        for cell in self.grid.cells_overlapping(box):
            cell_box = self.grid.cell_box(cell)
            part = box.intersect(cell_box)  # type: ignore[arg-type]
            if part is not None:
                yield part, self.grid.holders(cell)


class ZeroState:
    """Optimizer state sharded over data parallel as Megatron's distributed optimizer shards it."""

    def __init__(self, spec: ModelSpec, grid: GridPlacement, precision: Precision = Precision.FP32) -> None:
        self.spec = spec
        self.grid = grid
        self.tensor = grid.tensor
        self.group = buffer_group(self.tensor, grid.layout)
        self.precision = precision
        self._atoms: dict[tuple, list[tuple[Box, int]]] = {}

    # where shard index d sits on the mesh
    def _shard_pins(self, shard: int) -> dict[str, int]:
        # Expert tensors in the dense buffer (ep == 1 forces etp == tp) still shard over edp, which then
        # coincides with Megatron's dp x cp group, rank for rank.
        if self.grid.expert_mesh:
            return {"edp": shard}
        return {"cp": shard % self.grid.layout.cp, "dp": shard // self.grid.layout.cp}

    def _shard_index(self, rank: int) -> int:
        layout = self.grid.layout
        if self.grid.expert_mesh:
            return layout.expert_coord(rank).edp
        return layout.dp_cp_index(rank)

    def _buffer(self, home: tuple[int, int]) -> ShardBuffer:
        """The buffer of the model chunk ``home`` = (pipeline rank, chunk): megatron's DDP wraps each
        chunk alone, and the distributed optimizer shards each chunk's buffers."""
        stage, chunk = home
        return shard_buffer(self.spec, self.grid.layout, stage, self.group, self.precision,
                            param_dtype_of(self.tensor, self.precision), chunk=chunk)

    def _atoms_of(self, cell: Cell, home: tuple[int, int], stack: tuple[int, ...]
                  ) -> list[tuple[Box, int, tuple[int, int]]]:
        """Atoms of one local tensor: (valid box, owning shard, flat range of the tensor that shard covers)."""
        key = (cell, home, stack)
        found = self._atoms.get(key)
        if found is not None:
            return found  # type: ignore[return-value]
        grid = self.grid
        cell_box = grid.cell_box(cell)
        assert cell_box is not None
        n_stack = self.tensor.stack_axes
        local_stack = tuple(s - l for s, l in zip(stack, cell_box.lo[:n_stack]))
        buf = self._buffer(home)
        entry = buf.index[(self.tensor.name, local_stack)]
        view = grid.local_shape()
        shift = stack + grid.local_origin(cell)
        out = []
        for shard in buf.shards_of(entry):
            lo, hi = buf.shard_range(entry.bucket, shard)
            start, stop = max(lo, entry.start) - entry.start, min(hi, entry.stop) - entry.start
            for local in decompose_flat(view, start, stop):
                box = Box((0,) * n_stack + local.lo, (1,) * n_stack + local.hi).shift(shift).intersect(cell_box)
                if box is not None:  # None: vocabulary padding, a don't-care region
                    out.append((box, shard, (start, stop)))
        self._atoms[key] = out  # type: ignore[assignment]
        return out

    def regions(self, rank: int) -> list[Region]:
        stage = self.grid.coord(rank).pp
        out = []
        for cell in self.grid.cells_of(rank):
            cell_box = self.grid.cell_box(cell)
            if cell_box is not None:
                home = next(h for h in self.grid.homes(cell) if h[0] == stage)
                out += self._cell_regions(cell, cell_box, home, self._shard_index(rank))
        return out

    def _cell_regions(self, cell: Cell, cell_box: Box, home: tuple[int, int], shard: int) -> list[Region]:
        buf = self._buffer(home)
        n_stack = self.tensor.stack_axes
        origin_tail = self.grid.local_origin(cell)
        view = self.grid.local_shape()
        out = []
        # only the tensor's entries that this shard's ranges overlap
        for bucket in range(len(buf.buckets)):
            lo, hi = buf.shard_range(bucket, shard)
            for entry in buf.entries_in(self.tensor.name, lo, hi):
                stack = tuple(s + l for s, l in zip(entry.stack, cell_box.lo[:n_stack]))
                for box, owner, flat in self._atoms_of(cell, home, stack):
                    if owner == shard:
                        out.append(Region(box, stack + origin_tail, view, flat))
        return out

    def pieces(self, box: Box) -> Iterator[Piece]:
        n_stack = self.tensor.stack_axes
        for cell in self.grid.cells_overlapping(box):
            cell_box = self.grid.cell_box(cell)
            part = box.intersect(cell_box)  # type: ignore[arg-type]
            if part is None:
                continue
            homes = self.grid.homes(cell)
            for stack in _stack_indices(part, n_stack):
                atoms = self._atoms_of(cell, homes[0], stack)
                if len(homes) > 1:
                    # tied embedding: Megatron gives it its own bucket so both stages shard it alike
                    assert all(
                        [(b, s) for b, s, _ in self._atoms_of(cell, home, stack)] == [(b, s) for b, s, _ in atoms]
                        for home in homes[1:]
                    ), f"{self.tensor.name}: end stages shard the tied embedding differently"
                for atom, shard, _ in atoms:
                    inter = atom.intersect(part)
                    if inter is not None:
                        yield inter, self.grid.holders(cell, self._shard_pins(shard))


def _stack_indices(box: Box, n_stack: int) -> Iterator[tuple[int, ...]]:
    if n_stack == 0:
        yield ()
    elif n_stack == 1:
        for i in range(box.lo[0], box.hi[0]):
            yield (i,)
    else:
        for i in range(box.lo[0], box.hi[0]):
            for j in range(box.lo[1], box.hi[1]):
                yield (i, j)


StatePlacement = GridState | ZeroState


@lru_cache(maxsize=8192)
def state_placement(spec: ModelSpec, layout: ParallelConfig, tensor: str, sharded: bool,
                    precision: Precision = Precision.FP32) -> StatePlacement:
    """How one tensor's state is distributed: ``sharded`` for zero1 optimizer state (which follows
    megatron's buffers, one per param dtype: ``precision`` says which a tensor is in)."""
    grid = grid_placement(spec, tensor, layout)
    return ZeroState(spec, grid, precision) if sharded else GridState(grid)


def is_sharded(layout: ParallelConfig, kind: StateKind) -> bool:
    """Zero1 shards the optimizer's state (main params, moments), never the model params."""
    return layout.zero == 1 and kind is not StateKind.PARAM


def rank_regions(
    spec: ModelSpec, layout: ParallelConfig, rank: int, precision: Precision = Precision.FP32, *,
    weights_only: bool = False,
) -> dict[tuple[str, StateKind], list[Region]]:
    """F_P(layout, rank): every (tensor, state kind) the rank holds, with its regions
    (``weights_only``: its params alone)."""
    out: dict[tuple[str, StateKind], list[Region]] = {}
    for tensor in spec.tensors:
        for kind, _ in precision.kinds_of(tensor):
            if weights_only and kind is not StateKind.PARAM:
                continue
            sharded = is_sharded(layout, kind)
            regions = state_placement(spec, layout, tensor.name, sharded, precision if sharded else Precision.FP32
                                      ).regions(rank)
            dtype = precision.dtype_name(kind, tensor)
            if regions:
                out[(tensor.name, kind)] = regions if dtype == "float32" else [r._replace(dtype=dtype) for r in regions]
    return out


def held_boxes(spec: ModelSpec, layout: ParallelConfig, precision: Precision = Precision.FP32,
               ranks: Iterable[int] | None = None) -> Iterator[tuple[str, StateKind, Box, tuple[int, ...]]]:
    """Every box of ``layout``'s state that one of ``ranks`` holds (default: every rank), once, with
    all its holders: ``(tensor, kind, box, holders)``, in the spec's tensor order."""
    ranks = range(layout.world_size) if ranks is None else sorted(ranks)
    for tensor in spec.tensors:
        for kind, _ in precision.kinds_of(tensor):
            sharded = is_sharded(layout, kind)
            placement = state_placement(spec, layout, tensor.name, sharded, precision if sharded else Precision.FP32)
            seen: set[Box] = set()
            for rank in ranks:
                for region in placement.regions(rank):
                    for box, holders in placement.pieces(region.box):
                        if box not in seen:
                            seen.add(box)
                            yield tensor.name, kind, box, tuple(holders)
