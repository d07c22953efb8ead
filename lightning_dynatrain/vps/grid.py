"""Where a logical tensor lives when its state is not flat-sharded: a grid of cells.

Every split axis of a tensor (``layer`` by pp, ``expert`` by ep, ``tp``/``vocab`` by tp or etp) cuts it
into contiguous ranges, equal but for the layers of an uneven pipeline (``ParallelConfig.layer_cuts``);
a *cell* is one range per split axis. A rank holds one cell of each tensor it holds, and a cell is
held by every rank that agrees on the split coordinates (its replicas: data parallel, context
parallel, tensor parallel for replicated tensors, and both end stages for a tied embedding). The
layer axis is cut into ``pp * vpp`` blocks, block ``k`` on pipeline rank ``k % pp`` in its model
chunk ``k // pp``: with virtual stages a rank holds ``vpp`` cells of a layer tensor, one per chunk
(``cells_of``; ``homes`` says a cell's rank and chunk).

A vocabulary axis is split after Megatron pads it for this layout's tp: a vocabulary of 100 with
``make_vocab_size_divisible_by=64`` is 128 rows at tp=1 and tp=2 and 256 at tp=4, so at tp=2 the
cells are ``[0:64)`` and ``[64:128)``. The logical axis is as long as the largest padding of any
layout (``ModelSpec.vocab_rows``); rows past this layout's padded size are held by no rank.

Example, ``linear_fc2.weight`` ``[layers=4, hidden=8, ffn=16]`` axes ``(layer, "", tp)`` at ``dp2-tp2-pp2``:
rank 5 (tp1, dp0, pp1) holds cell ``(1, 1)`` = box ``[2:4, 0:8, 8:16]``, with replica rank 7.
"""

from __future__ import annotations

import bisect
import itertools
from functools import lru_cache
from typing import Iterator

from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import DenseCoord, ExpertCoord, ParallelConfig
from lightning_dynatrain.vps.spec import EXPERT, LAYER, TP, VOCAB, Group, LogicalTensor, ModelSpec, Place

Cell = tuple[int, ...]


class GridPlacement:
    """The grid of one logical tensor under one layout. Pure; build through ``grid_placement``."""

    def __init__(self, spec: ModelSpec, tensor: LogicalTensor, layout: ParallelConfig) -> None:
        self.spec = spec
        self.tensor = tensor
        self.layout = layout
        self.expert_mesh = tensor.group is Group.EXPERT
        tp_size = layout.etp if self.expert_mesh else layout.tp
        tp_dim = "etp" if self.expert_mesh else "tp"
        # per split axis: (axis, mesh dimension, parts, cuts): part i is [cuts[i], cuts[i + 1])
        splits: list[tuple[int, str, int, tuple[int, ...]]] = []
        # end of each axis in this layout (a vocabulary axis ends at this layout's padded size)
        self.limits = list(tensor.shape)
        for axis, role in enumerate(tensor.axes):
            if role == LAYER:
                splits.append((axis, "pp", layout.pp * layout.vpp, layout.layer_cuts(tensor.shape[axis])))
            elif role == EXPERT:
                splits.append((axis, "ep", layout.ep, _even(tensor.shape[axis] // layout.ep, layout.ep)))
            elif role == TP:
                splits.append((axis, tp_dim, tp_size, _even(tensor.shape[axis] // tp_size, tp_size)))
            elif role == VOCAB:
                splits.append((axis, tp_dim, tp_size, _even(spec.padded_vocab(tp_size) // tp_size, tp_size)))
                self.limits[axis] = spec.padded_vocab(tp_size)
        self.splits = tuple(splits)
        self.split_dims = frozenset(d for _, d, _, _ in splits)
        #: which split cuts the layer axis (its index in a cell), if any
        self.layer_split = next((i for i, (_, d, _, _) in enumerate(splits) if d == "pp"), None)
        self.stages = self._stages()
        self._holders: dict[tuple, tuple[int, ...]] = {}
        self._cell_boxes: dict[Cell, Box | None] = {}

    def _stages(self) -> tuple[int, ...]:
        place, pp = self.tensor.place, self.layout.pp
        if place is Place.LAYERS:
            return tuple(range(pp))
        if place is Place.FIRST:
            return (0,)
        if place is Place.LAST:
            return (pp - 1,)
        return (0,) if pp == 1 else (0, pp - 1)

    # ------------------------------------------------------------------ cells
    def cells_of(self, rank: int) -> tuple[Cell, ...]:
        """The cells ``rank`` holds: one, or one per model chunk of a layer tensor with virtual
        stages (in chunk order); none when its stage holds none of this tensor."""
        c = self.coord(rank)
        if c.pp not in self.stages:
            return ()
        cell = [getattr(c, dim) for _, dim, _, _ in self.splits]
        if self.layer_split is None:
            return (tuple(cell),)
        out = []
        for chunk in range(self.layout.vpp):
            cell[self.layer_split] = chunk * self.layout.pp + c.pp
            out.append(tuple(cell))
        return tuple(out)

    def homes(self, cell: Cell) -> tuple[tuple[int, int], ...]:
        """Where ``cell`` lives: its (pipeline rank, model chunk), two of them for an embedding tied
        over the first stage's first chunk and the last stage's last chunk."""
        pp, vpp = self.layout.pp, self.layout.vpp
        if self.layer_split is not None:
            block = cell[self.layer_split]
            return ((block % pp, block // pp),)
        place = self.tensor.place
        if place is Place.FIRST:
            return ((0, 0),)
        if place is Place.LAST:
            return ((pp - 1, vpp - 1),)
        if place is Place.FIRST_AND_LAST:
            return ((0, 0),) if pp == 1 else ((0, 0), (pp - 1, vpp - 1))
        return tuple((stage, 0) for stage in self.stages)

    def coord(self, rank: int) -> DenseCoord | ExpertCoord:
        if self.expert_mesh:
            return self.layout.expert_coord(rank)
        return self.layout.dense_coord(rank)

    def cell_box(self, cell: Cell) -> Box | None:
        """The valid logical box of a cell (padding excluded); ``None`` if it is all padding."""
        try:
            return self._cell_boxes[cell]
        except KeyError:
            box = self._cell_boxes[cell] = self._make_cell_box(cell)
            return box

    def _make_cell_box(self, cell: Cell) -> Box | None:
        lo = [0] * self.tensor.ndim
        hi = list(self.tensor.shape)
        for (axis, _, _, cuts), index in zip(self.splits, cell):
            lo[axis] = cuts[index]
            hi[axis] = min(cuts[index + 1], self.limits[axis])
            if hi[axis] <= lo[axis]:
                return None
        return Box(tuple(lo), tuple(hi))

    def local_origin(self, cell: Cell) -> tuple[int, ...]:
        """Logical coordinates of element 0 of the local tensor (non-stack axes)."""
        origin = [0] * self.tensor.ndim
        for (axis, _, _, cuts), index in zip(self.splits, cell):
            origin[axis] = cuts[index]
        return tuple(origin[self.tensor.stack_axes:])

    def local_shape(self) -> tuple[int, ...]:
        """Shape of one local tensor viewed on the logical axes (non-stack axes, padding included; the
        split of a non-stack axis is even)."""
        shape = list(self.tensor.shape)
        for axis, _, _, cuts in self.splits:
            shape[axis] = cuts[1] - cuts[0]
        return tuple(shape[self.tensor.stack_axes:])

    def local_stack(self, cell: Cell) -> tuple[range, ...]:
        """Global layer/expert indices of the separate local tensors of a cell, per stack axis."""
        box = self.cell_box(cell)
        assert box is not None
        return tuple(range(box.lo[a], box.hi[a]) for a in range(self.tensor.stack_axes))

    def cells_overlapping(self, box: Box) -> Iterator[Cell]:
        """Cells (with a valid part) that intersect ``box``."""
        ranges = []
        for axis, _, parts, cuts in self.splits:
            first = bisect.bisect_right(cuts, box.lo[axis]) - 1
            last = min(bisect.bisect_right(cuts, box.hi[axis] - 1) - 1, parts - 1)
            ranges.append(range(first, last + 1))
        for cell in itertools.product(*ranges):
            if self.cell_box(cell) is not None:
                yield cell

    # ---------------------------------------------------------------- holders
    def holders(self, cell: Cell, fixed: dict[str, int] | None = None) -> tuple[int, ...]:
        """Ranks holding ``cell``, sorted. ``fixed`` pins more mesh dimensions (e.g. the zero shard)."""
        key = (cell, tuple(sorted(fixed.items())) if fixed else ())
        found = self._holders.get(key)
        if found is None:
            found = self._holders[key] = self._enumerate_holders(cell, fixed)
        return found

    def _enumerate_holders(self, cell: Cell, fixed: dict[str, int] | None) -> tuple[int, ...]:
        pinned = dict(zip((d for _, d, _, _ in self.splits), cell))
        if "pp" in pinned:  # a layer block's pipeline rank (its chunk does not change who holds it)
            pinned["pp"] %= self.layout.pp
        if fixed:
            pinned.update(fixed)
        layout = self.layout
        if self.expert_mesh:
            sizes = {"etp": layout.etp, "ep": layout.ep, "edp": layout.edp}
            dims = ("etp", "ep", "edp")
        else:
            sizes = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp}
            dims = ("tp", "cp", "dp")
        stages = (pinned["pp"],) if "pp" in pinned else self.stages
        choices = [(pinned[d],) if d in pinned else range(sizes[d]) for d in dims]
        ranks = []
        for pp in stages:
            for a, b, c in itertools.product(*choices):
                if self.expert_mesh:
                    ranks.append(layout.expert_rank(ExpertCoord(a, b, c, pp)))
                else:
                    ranks.append(layout.dense_rank(DenseCoord(a, b, c, pp)))
        return tuple(sorted(ranks))


def _even(width: int, parts: int) -> tuple[int, ...]:
    return tuple(i * width for i in range(parts + 1))


@lru_cache(maxsize=4096)
def grid_placement(spec: ModelSpec, tensor_name: str, layout: ParallelConfig) -> GridPlacement:
    return GridPlacement(spec, spec.tensor(tensor_name), layout)
