"""Baseline: the naive in-memory switch. Every rank all-gathers every full logical tensor, then slices.

For each ``(tensor, kind)`` of the old layout, slice by slice (one layer / expert at a time, and
rows of at most ``chunk_elements``, so the scratch stays small): every rank packs whatever it holds
of the slice (replicas included: that is what makes it naive), one ``all_gather`` over the world
(gloo needs equal sizes: padded to the largest contribution), the full slice is assembled from each
distinct box once, and every rank copies the boxes its new layout needs into its new storage.

Example (every rank, old and new state both alive)::

    seconds = allgather_switch(store_a, store_b, spec, layout_a, layout_b, rank)
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_dynatrain.transition.pieces import LayoutPieces, Piece, layout_pieces
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind

CHUNK_ELEMENTS = 1 << 23  # 32 MiB of fp32 per gathered slice


@dataclass(frozen=True, slots=True)
class GatherStats:
    """One rank's figures: collectives run, bytes it received through them, seconds in them."""

    collectives: int
    recv_bytes: int
    gather_seconds: float
    seconds: float


def _slices(shape: tuple[int, ...], n_stack: int, chunk_elements: int) -> Iterator[Box]:
    """One box per stack index, cut into row ranges on the first non-stack axis."""
    stacks = [range(s) for s in shape[:n_stack]]
    tail = shape[n_stack:]
    row = math.prod(tail[1:]) if len(tail) > 1 else 1
    rows = max(1, chunk_elements // max(1, row)) if tail else 1

    def cells(i: int, prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if i == len(stacks):
            yield prefix
            return
        for s in stacks[i]:
            yield from cells(i + 1, prefix + (s,))

    for stack in cells(0, ()):
        if not tail:
            yield Box(stack, tuple(s + 1 for s in stack))
            continue
        for r0 in range(0, tail[0], rows):
            r1 = min(tail[0], r0 + rows)
            yield Box(stack + (r0,) + (0,) * (len(tail) - 1), tuple(s + 1 for s in stack) + (r1,) + tail[1:])


def _parts(pieces: tuple[Piece, ...], slice_box: Box) -> list[tuple[Piece, Box]]:
    out = []
    for p in pieces:
        inter = p.box.intersect(slice_box)
        if inter is not None:
            out.append((p, inter))
    return out


def _sub(view: torch.Tensor, piece: Piece, box: Box) -> torch.Tensor:
    return view[box.relative_to(piece.box.lo)]


def allgather_switch(source: dict, dest: dict, spec: ModelSpec, src: ParallelConfig, dst: ParallelConfig, rank: int,
                     *, precision: Precision = Precision.FP32, chunk_elements: int = CHUNK_ELEMENTS,
                     group: dist.ProcessGroup | None = None,
                     kinds: tuple[StateKind, ...] | None = None) -> GatherStats:
    """Fill ``dest`` (the new layout's live tensors) from ``source`` (the old layout's); collective.
    ``kinds``: only these state kinds (``(StateKind.PARAM,)``: a weights-only refit); default all."""
    start = time.perf_counter()
    old, new = layout_pieces(spec, src, precision), layout_pieces(spec, dst, precision)
    world = dist.get_world_size(group)
    collectives = recv_bytes = 0
    gather_s = 0.0
    for tk in old.holders:
        if kinds is not None and tk[1] not in kinds:
            continue
        tensor = spec.tensor(tk[0])
        shape = old.stored_shape[tk[0]]
        for slice_box in _slices(shape, tensor.stack_axes, chunk_elements):
            parts = [_parts(old.of_rank[r].get(tk, ()), slice_box) if r < len(old.of_rank) else [] for r in range(world)]
            sizes = [sum(b.numel for _, b in ps) for ps in parts]
            if not any(sizes):
                continue
            send = torch.empty(max(sizes), dtype=_dtype(precision, tk[1]))
            offset = 0
            for p, b in parts[rank]:
                send[offset:offset + b.numel].view(b.shape).copy_(_sub(p.view(source), p, b))
                offset += b.numel
            received = [torch.empty_like(send) for _ in range(world)]
            t0 = time.perf_counter()
            dist.all_gather(received, send, group=group)
            gather_s += time.perf_counter() - t0
            collectives += 1
            recv_bytes += (world - 1) * send.numel() * send.element_size()
            full = _assemble(old, tk, slice_box, parts, received)
            for p, b in _parts(new.of_rank[rank].get(tk, ()), slice_box):
                _sub(p.view(dest), p, b).copy_(full[b.relative_to(slice_box.lo)])
            del send, received, full
    return GatherStats(collectives, recv_bytes, gather_s, time.perf_counter() - start)


def _dtype(precision: Precision, kind: StateKind) -> torch.dtype:
    """Every rank must gather the same dtype, also ranks that hold nothing of the slice."""
    return torch.bfloat16 if precision is Precision.BF16 and kind is StateKind.PARAM else torch.float32


def _assemble(old: LayoutPieces, tk, slice_box: Box, parts: list, received: list[torch.Tensor]) -> torch.Tensor:
    """The full slice from every rank's contribution, each distinct box copied once."""
    full = torch.empty(slice_box.shape, dtype=received[0].dtype)
    seen: set[Box] = set()
    for r, ps in enumerate(parts):
        offset = 0
        for p, b in ps:
            if b not in seen:
                seen.add(b)
                full[b.relative_to(slice_box.lo)] = received[r][offset:offset + b.numel].view(b.shape)
            offset += b.numel
    return full


__all__ = ["GatherStats", "allgather_switch"]
