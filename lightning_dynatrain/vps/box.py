"""Boxes: half-open intervals per logical axis, and the decomposition of flat ranges into boxes.

A box is the unit every layer of the VPS speaks in. ``Box((0, 4), (2, 8))`` is rows 0..1 and
columns 4..7 of a ``[rows, cols]`` tensor; it prints as ``[0:2, 4:8]``.

Boxes are ``NamedTuple`` (immutable, hashable, cheap to make: the planner makes millions of them at
cluster scale) rather than dataclasses.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple, Sequence


class Box(NamedTuple):
    """Half-open box ``[lo[a], hi[a])`` on each axis ``a``."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @staticmethod
    def full(shape: Sequence[int]) -> "Box":
        return Box(tuple(0 for _ in shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.lo)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(h - l for l, h in zip(self.lo, self.hi))

    @property
    def numel(self) -> int:
        n = 1
        for l, h in zip(self.lo, self.hi):
            n *= h - l
        return n

    def is_empty(self) -> bool:
        return any(h <= l for l, h in zip(self.lo, self.hi))

    def intersect(self, other: "Box") -> "Box | None":
        """The common part of two boxes, or ``None`` when they do not overlap."""
        lo = []
        hi = []
        for a_lo, a_hi, b_lo, b_hi in zip(self.lo, self.hi, other.lo, other.hi):
            l = a_lo if a_lo > b_lo else b_lo
            h = a_hi if a_hi < b_hi else b_hi
            if h <= l:
                return None
            lo.append(l)
            hi.append(h)
        return Box(tuple(lo), tuple(hi))

    def contains(self, other: "Box") -> bool:
        return all(a <= b and d <= c for a, c, b, d in zip(self.lo, self.hi, other.lo, other.hi))

    def shift(self, offset: Sequence[int]) -> "Box":
        """The box moved by ``+offset`` on every axis."""
        return Box(
            tuple(l + o for l, o in zip(self.lo, offset)), tuple(h + o for h, o in zip(self.hi, offset))
        )

    def relative_to(self, origin: Sequence[int]) -> tuple[slice, ...]:
        """Slices that pick this box out of a tensor whose element 0 sits at ``origin``."""
        return tuple(slice(l - o, h - o) for l, h, o in zip(self.lo, self.hi, origin))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{l}:{h}" for l, h in zip(self.lo, self.hi)) + "]"


def ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    """Row-major flat position of ``index`` in a tensor of ``shape``."""
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def decompose_flat(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes whose union is the flat row-major range ``[start, stop)`` of a tensor of ``shape``.

    Each box is contiguous in row-major order (a fixed prefix, one partial axis, full trailing
    axes), so a flat shard is addressed box by box with plain offsets. For a matrix the result is at
    most three boxes (head row, full rows, tail row); in general at most ``2 * ndim - 1``.

    >>> [str(b) for b in decompose_flat((3, 4), 2, 11)]
    ['[0:1, 2:4]', '[1:2, 0:4]', '[2:3, 0:3]']
    """
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of shape {shape}")
    out: list[Box] = []
    _decompose(shape, start, stop, (), out)
    return out


def _decompose(shape: tuple[int, ...], start: int, stop: int, prefix: tuple[int, ...], out: list[Box]) -> None:
    if start >= stop:
        return
    rest = shape[1:]
    upper = tuple(i + 1 for i in prefix)
    if not rest:
        out.append(Box(prefix + (start,), upper + (stop,)))
        return
    inner = math.prod(rest)
    first_full = -(-start // inner)
    end_full = stop // inner
    if first_full > end_full:
        # start and stop fall in the same row: recurse into it.
        row = start // inner
        _decompose(rest, start - row * inner, stop - row * inner, prefix + (row,), out)
        return
    if start % inner:
        row = first_full - 1
        _decompose(rest, start - row * inner, inner, prefix + (row,), out)
    if end_full > first_full:
        zeros = (0,) * len(rest)
        out.append(Box(prefix + (first_full,) + zeros, upper + (end_full,) + rest))
    if stop % inner:
        _decompose(rest, 0, stop - end_full * inner, prefix + (end_full,), out)


def iter_cells(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    """All index tuples of a product of ranges, last axis fastest."""
    if not ranges:
        yield ()
        return
    head, *tail = ranges
    for i in head:
        for rest in iter_cells(tail):
            yield (i,) + rest
