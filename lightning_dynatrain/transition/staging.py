"""Memory-aware staging: which boxes travel together in one pack buffer, within a byte budget.

For one pair of ranks in one XOR step, the boxes each side sends are packed, in plan order, into one
contiguous byte buffer per *stage*; a stage holds boxes while its send bytes plus its receive bytes
fit the budget. Both sides compute the stages from the same two lists (the lower rank's sends first),
so they agree on every stage, every offset and every byte without talking.

A box bigger than the per-direction limit is split along its outermost axis of extent > 1, into
runs of whole slabs, recursively. The smallest unit is one *row*: extent 1 on every axis but the
last, the last axis whole. A row is never split, so the budget must hold the largest row of the
switch (``smallest_unit_bytes``); the engine checks that on every rank before anything moves.

Example: a ``[6, 4]`` fp32 box (96 bytes) with a 40-byte limit splits into ``[0:2, 0:4]``,
``[2:4, 0:4]``, ``[4:6, 0:4]`` (32 bytes each); with a 12-byte budget nothing fits (a row is 16 bytes).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from lightning_dynatrain.transition.errors import StagingBudgetError
from lightning_dynatrain.vps.box import Box

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")

#: The second part of a stage buffer starts at a multiple of this many bytes; inside a part each
#: chunk starts at a multiple of its element size, so every ``uint8`` slice can be viewed as its dtype.
ALIGN = 16


def parse_bytes(value: int | str) -> int:
    """A byte count from an int or a string like ``"256MiB"``, ``"1GB"``, ``"512KiB"``, ``"4096"``.

    Binary units (KiB, MiB, GiB, TiB; also K, M, G) are powers of 1024, decimal ones (KB, MB, GB, TB)
    powers of 1000. Case and spaces do not matter.

    Raises:
        StagingBudgetError: not a positive whole number of bytes, or an unknown unit.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise StagingBudgetError(f"cannot read a byte count from {value!r}", hint='write e.g. "256MiB" or 268435456')
    if isinstance(value, int):
        number = value
    else:
        match = _BYTES.match(value.lower())
        if match is None or match.group(2) not in _UNITS:
            raise StagingBudgetError(
                f"cannot read a byte count from {value!r}",
                hint='write a number with an optional unit B, KiB, MiB, GiB, TiB, KB, MB, GB or TB, e.g. "256MiB"',
            )
        number = int(float(match.group(1)) * _UNITS[match.group(2)])
    if number <= 0:
        raise StagingBudgetError(f"a byte count must be positive, got {value!r}", hint='write e.g. "256MiB"')
    return number


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``: a byte count for messages and reports."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def smallest_unit_bytes(box: Box, itemsize: int) -> int:
    """Bytes of the smallest piece of ``box`` the engine moves: one row along the last axis."""
    return box.shape[-1] * itemsize


def split_box(box: Box, itemsize: int, limit: int) -> list[Box]:
    """``box`` cut into sub-boxes of at most ``limit`` bytes each (rows are never cut).

    Cuts along the outermost axis of extent > 1 into runs of ``limit // slab`` slabs; a single slab
    still over the limit is cut the same way along the next axis. Deterministic in its inputs, so
    sender and receiver cut alike. The sub-boxes tile ``box`` in row-major order.
    """
    if box.numel * itemsize <= limit or all(e == 1 for e in box.shape[:-1]):
        return [box]
    axis = next(a for a, e in enumerate(box.shape) if e > 1)
    extent = box.shape[axis]
    slab = box.numel // extent * itemsize
    per = max(1, limit // slab)
    out: list[Box] = []
    for start in range(box.lo[axis], box.hi[axis], per):
        stop = min(start + per, box.hi[axis])
        sub = Box(box.lo[:axis] + (start,) + box.lo[axis + 1:], box.hi[:axis] + (stop,) + box.hi[axis + 1:])
        out.extend(split_box(sub, itemsize, limit) if slab > limit else [sub])
    return out


class Chunk(NamedTuple):
    """A piece of one transfer: ``item`` indexes the transfer list, ``box`` is the piece."""

    item: int
    box: Box
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.itemsize


class Slot(NamedTuple):
    """Where a chunk sits in its stage's buffer."""

    chunk: Chunk
    offset: int


class Stage(NamedTuple):
    """One exchange of one pair: ``low`` goes from the lower rank to the higher, ``high`` back."""

    low: tuple[Slot, ...]
    high: tuple[Slot, ...]
    low_bytes: int
    high_bytes: int

    @property
    def nbytes(self) -> int:
        return stage_bytes(self.low_bytes, self.high_bytes)


def _align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def stage_bytes(low_bytes: int, high_bytes: int) -> int:
    """Bytes of one stage's buffer: the low part, then the high part from an aligned offset."""
    return low_bytes if not high_bytes else _align(low_bytes) + high_bytes


def high_offset(low_bytes: int) -> int:
    """Where the high part of a stage starts in the stage's buffer."""
    return _align(low_bytes)


def chunk_transfers(boxes: Sequence[tuple[Box, int]], limit: int) -> list[Chunk]:
    """Chunks of ``(box, itemsize)`` items in order, each at most ``limit`` bytes unless it is a row."""
    return [Chunk(i, sub, size) for i, (box, size) in enumerate(boxes) for sub in split_box(box, size, limit)]


def plan_stages(low: Sequence[tuple[Box, int]], high: Sequence[tuple[Box, int]], budget: int) -> list[Stage]:
    """The stages of one pair: ``low`` the lower rank's sends, ``high`` the higher rank's, in plan order.

    When both directions carry data each is split to half the budget, so one stage moves both ways
    at once; a row that only fits the whole budget travels alone. Chunks are taken alternately from
    the two directions while they fit. Every stage fits the budget as long as every row does.
    """
    limit = budget // 2 if low and high else budget
    a = chunk_transfers(low, limit)
    b = chunk_transfers(high, limit)
    stages: list[Stage] = []
    ia = ib = 0
    while ia < len(a) or ib < len(b):
        slots_a: list[Slot] = []
        slots_b: list[Slot] = []
        size_a = size_b = 0
        progressed = True
        while progressed:
            progressed = False
            if ia < len(a):
                off = _align(size_a, a[ia].itemsize)
                end = off + a[ia].nbytes
                if stage_bytes(end, size_b) <= budget or not (slots_a or slots_b):
                    slots_a.append(Slot(a[ia], off))
                    size_a, ia, progressed = end, ia + 1, True
            if ib < len(b):
                off = _align(size_b, b[ib].itemsize)
                end = off + b[ib].nbytes
                if stage_bytes(size_a, end) <= budget or not (slots_a or slots_b):
                    slots_b.append(Slot(b[ib], off))
                    size_b, ib, progressed = end, ib + 1, True
        stages.append(Stage(tuple(slots_a), tuple(slots_b), size_a, size_b))
    return stages


def check_budget(budget: int, needed: int, *, what: str = "") -> None:
    """Raise ``StagingBudgetError`` when the budget cannot hold the switch's smallest unit."""
    if needed > budget:
        raise StagingBudgetError(
            f"staging budget {format_bytes(budget)} ({budget} bytes) is too small for this switch: its "
            f"smallest unit (one row along the last axis{what}) takes {format_bytes(needed)} ({needed} bytes)",
            hint=f"raise staging_budget to at least {needed} bytes (\"{-(-needed // 2**10)}KiB\")",
        )


__all__ = [
    "ALIGN",
    "Chunk",
    "Slot",
    "Stage",
    "check_budget",
    "chunk_transfers",
    "format_bytes",
    "parse_bytes",
    "plan_stages",
    "high_offset",
    "smallest_unit_bytes",
    "split_box",
    "stage_bytes",
]
