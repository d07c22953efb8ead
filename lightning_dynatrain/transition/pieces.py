"""Every rank's boxes of a layout, cut per local tensor, and which rank is the primary holder of each.

A *piece* is a region's box restricted to one local tensor (one layer, one expert): the unit a
checkpoint chunk, a fingerprint term or an all-gather contribution is made of. Across the ranks of
a layout the pieces of one ``(tensor, kind)`` are either identical (replicas: data parallel, or the
tied embedding's two stages) or disjoint, and together they cover the tensor's *stored* extent
(the logical shape with the vocabulary axis at the layout's padded size). The primary holder of a
piece is the lowest rank holding it: it alone writes the piece to a checkpoint or hashes it.

Example, ``dp2-tp1-pp1``: ranks 0 and 1 both hold ``decoder.layers.mlp.linear_fc2.weight:param``
layer 3 ``[3:4, 0:h, 0:f]``; its holders are ``(0, 1)``, rank 0 is primary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from lightning_dynatrain.transition.local_state import box_pieces, box_view
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import Region, rank_regions
from lightning_dynatrain.vps.spec import VOCAB, ModelSpec, Precision, StateKind

TensorKind = tuple[str, StateKind]


@dataclass(frozen=True, slots=True)
class Piece:
    """One box inside one local tensor of a rank: ``store[key]`` seen through ``region``."""

    key: tuple  # the engine's StoreKey (tensor, kind, global stack index)
    region: Region
    box: Box

    def view(self, store: dict) -> torch.Tensor:
        """The piece as a tensor of shape ``box.shape`` (stack axes kept as size-1 axes); a view,
        so writing to it writes the rank's state."""
        view = box_view(store[self.key], self.region, self.box)
        while view.dim() < len(self.box.lo):
            view = view.unsqueeze(0)
        return view


@dataclass(frozen=True, slots=True)
class LayoutPieces:
    """All ranks' pieces of one layout: ``of_rank[rank][(tensor, kind)]`` and the holders of each box."""

    layout: ParallelConfig
    of_rank: tuple[dict[TensorKind, tuple[Piece, ...]], ...]
    holders: dict[TensorKind, dict[Box, tuple[int, ...]]]
    stored_shape: dict[str, tuple[int, ...]]

    def primary(self, tk: TensorKind, box: Box) -> int:
        return self.holders[tk][box][0]

    def mine(self, rank: int, *, primary_only: bool) -> dict[TensorKind, list[Piece]]:
        """This rank's pieces, or only those it is the primary holder of."""
        out: dict[TensorKind, list[Piece]] = {}
        for tk, pieces in self.of_rank[rank].items():
            kept = [p for p in pieces if not primary_only or self.primary(tk, p.box) == rank]
            if kept:
                out[tk] = kept
        return out


def stored_shape(spec: ModelSpec, tensor: str, layout: ParallelConfig) -> tuple[int, ...]:
    """The logical shape with the vocabulary axis at ``layout``'s padded size (what its ranks hold)."""
    t = spec.tensor(tensor)
    axis = t.axis_of(VOCAB)
    if axis is None:
        return t.shape
    return t.shape[:axis] + (spec.padded_vocab(layout.tp),) + t.shape[axis + 1:]


def rank_pieces(spec: ModelSpec, layout: ParallelConfig, rank: int,
                precision: Precision = Precision.FP32) -> dict[TensorKind, tuple[Piece, ...]]:
    out: dict[TensorKind, tuple[Piece, ...]] = {}
    for (tensor, kind), regions in rank_regions(spec, layout, rank, precision).items():
        out[(tensor, kind)] = tuple(Piece(key, region, box) for region in regions
                                    for key, box in box_pieces(tensor, kind, region, region.box))
    return out


@lru_cache(maxsize=16)
def layout_pieces(spec: ModelSpec, layout: ParallelConfig, precision: Precision = Precision.FP32) -> LayoutPieces:
    """Pure metadata, the same on every rank (cached)."""
    of_rank = tuple(rank_pieces(spec, layout, r, precision) for r in range(layout.world_size))
    holders: dict[TensorKind, dict[Box, list[int]]] = {}
    for rank, pieces in enumerate(of_rank):
        for tk, lst in pieces.items():
            for p in lst:
                holders.setdefault(tk, {}).setdefault(p.box, []).append(rank)
    frozen = {tk: {b: tuple(r) for b, r in boxes.items()} for tk, boxes in holders.items()}
    shapes = {t.name: stored_shape(spec, t.name, layout) for t in spec.tensors}
    return LayoutPieces(layout, of_rank, frozen, shapes)


__all__ = ["LayoutPieces", "Piece", "layout_pieces", "rank_pieces", "stored_shape"]
