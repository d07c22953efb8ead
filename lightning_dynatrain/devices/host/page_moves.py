"""Moving whole pages of CPU memory from one address range to another, without copying (Linux).

A switch on CPU frees old state and writes new state. Writing a fresh page costs a fault and a
kernel zero (on a virtual machine that gave the page back to its host, a host fault as well);
writing a page the process already touched does not (``benchmarks/fresh_memory.py``). Carving new
tensors out of old storages (``recycler.StorageRecycler.take``) avoids fresh pages only where a
new tensor fits in one old storage's free run. Moving pages does not need that: ``mremap`` hands
the physical pages under one virtual range to another, so the whole pages inside any new tensor
can come from any number of old storages, and the new tensor keeps its own storage.

The source range stays mapped (``MREMAP_DONTUNMAP``, Linux 5.7+; else a fresh anonymous mapping
put back over it): its storage may still be read whole (``torch.save`` writes whole storages) and
is freed as usual later; reading there gives zeros, as after ``madvise(MADV_DONTNEED)``. What was
mapped in the destination range is unmapped first. Only ever move pages out of memory nothing will
read for its values again, into memory that will be written whole before it is read.

``mremap`` moves pages within one mapping only: a source range that spans several (memory made of
moved pages in an earlier switch) is moved piece by piece, halving on failure down to
``MIN_PIECE``; what cannot be moved stays, and the destination's pages there fault in as usual.

Callers move pages only out of private anonymous memory (``private_anonymous_ranges``; the
recycler checks every old storage against it): pages of a file mapped into memory (a checkpoint
loaded with ``torch.load(mmap=True)``) stay where they are. ``untouched_runs`` tells which pages of
a range are not in memory yet (``mincore``), and ``populate_pages`` faults pages in without writing
them (``madvise(MADV_POPULATE_WRITE)``).

Example::

    moved = move_pages(src_start, src_end, dst_start, dst_end)  # bytes moved (whole pages)
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import re
import sys
from collections.abc import Callable

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: the smallest piece worth a system call when a range has to be split
MIN_PIECE = 64 * _PAGE

_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4
_PROT_RW = 0x1 | 0x2
_MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x02, 0x10, 0x20
_MADV_DONTNEED, _MADV_POPULATE_WRITE = 4, 23
_FAILED = ctypes.c_void_p(-1).value
_NOT_RESIDENT = re.compile(rb"\x00+")


def _libc_calls() -> tuple[Callable, Callable, Callable, Callable, Callable] | None:
    """libc's ``mremap``, ``mmap``, ``mincore``, ``madvise`` and ``munmap`` (Linux), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mremap, mmap, mincore, madvise, munmap = libc.mremap, libc.mmap, libc.mincore, libc.madvise, libc.munmap
    except (OSError, AttributeError):
        return None
    munmap.restype = ctypes.c_int
    munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    madvise.restype = ctypes.c_int
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mremap.restype = ctypes.c_void_p
    mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    mmap.restype = ctypes.c_void_p
    mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    mincore.restype = ctypes.c_int
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return mremap, mmap, mincore, madvise, munmap


class _PageMover:
    """The system calls and what this kernel supports (probed on first use)."""

    def __init__(self) -> None:
        calls = _libc_calls()
        self.available = calls is not None
        self._mremap, self._mmap, self._mincore, self._madvise, self._munmap = calls if calls is not None else (None,) * 5
        self._dontunmap = True  # until the kernel says otherwise
        self._can_populate = True  # likewise

    def discard(self, start: int, length: int) -> bool:
        return self._madvise(start, length, _MADV_DONTNEED) == 0

    def populate(self, start: int, length: int) -> bool:
        if not self._can_populate:
            return False
        if self._madvise(start, length, _MADV_POPULATE_WRITE) == 0:
            return True
        if ctypes.get_errno() == errno.EINVAL:  # a kernel before 5.14
            self._can_populate = False
        return False

    def resident(self, start: int, length: int) -> bytes | None:
        """One byte per page of ``[start, start + length)`` (page-aligned): nonzero where the page is in memory."""
        vec = ctypes.create_string_buffer(length // _PAGE)
        if self._mincore(start, length, vec) != 0:
            return None
        return vec.raw

    def move(self, src: int, dst: int, length: int) -> bool:
        """Move ``length`` bytes of pages (all page-aligned) from ``src`` to ``dst``; ``False`` if not."""
        if self._dontunmap:
            flags = _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP
            if self._mremap(src, length, length, flags, dst) != _FAILED:
                return True
            if ctypes.get_errno() != errno.EINVAL:  # EFAULT: the range spans mappings
                return False
            self._dontunmap = False  # a kernel before 5.7
        if self._mremap(src, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, dst) == _FAILED:
            return False
        # put fresh (untouched) memory back where the pages were
        refill = self._mmap(src, length, _PROT_RW, _MAP_PRIVATE | _MAP_FIXED | _MAP_ANONYMOUS, -1, 0)
        if refill != src:
            raise OSError(ctypes.get_errno(), f"mmap could not map memory back at {src:#x} after moving its pages")
        return True

    def swap(self, a: int, b: int, length: int) -> bool:
        """Exchange the pages of ``[a, a + length)`` and ``[b, b + length)`` (page-aligned, apart)
        through a spare mapping; ``False`` with both as they were where the first two moves fail."""
        spare = self._mmap(None, length, _PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
        if spare in (None, _FAILED):
            return False
        try:
            if not self.move(b, spare, length):
                return False
            if not self.move(a, b, length):
                if not self.move(spare, b, length):
                    raise OSError(ctypes.get_errno(), f"mremap could not put the pages of {b:#x} back")
                return False
            self.move(spare, a, length)  # else a stays empty, and b's old pages go with the spare
            return True
        finally:
            self._munmap(spare, length)


_MOVER = _PageMover()


def can_move_pages() -> bool:
    """Whether ``move_pages`` can move memory here (Linux ``mremap``)."""
    return _MOVER.available


def page_span(start: int, end: int) -> tuple[int, int]:
    """The whole pages inside addresses ``[start, end)``, as ``(first, last)`` (empty: ``first >= last``)."""
    return -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE


def move_pages(src_start: int, src_end: int, dst_start: int, dst_end: int) -> int:
    """Move the whole pages of ``[src_start, src_end)`` into the whole pages of ``[dst_start, dst_end)``,
    from the start of each, as many as both hold; the bytes moved (0 where not possible). The two
    ranges must not overlap."""
    if not _MOVER.available:
        return 0
    src, src_last = page_span(src_start, src_end)
    dst, dst_last = page_span(dst_start, dst_end)
    length = min(src_last - src, dst_last - dst)
    if length <= 0:
        return 0
    if src < dst + length and dst < src + length:
        raise ValueError(f"move_pages: source {src:#x}+{length} and destination {dst:#x}+{length} overlap")
    return length - sum(n for _, n in _move(src, dst, length))


def swap_page_runs(src: int, dst: int, length: int) -> list[tuple[int, int]]:
    """Exchange ``length`` bytes of whole pages between ``src`` and ``dst`` (both page-aligned, not
    overlapping): ``dst`` then holds what ``src`` held, without a copy, and ``src`` the pages
    ``dst`` had (memory already touched, for whoever takes ``src`` over next; where ``dst`` had no
    pages, none). The runs that were not exchanged, as ``(offset, length)``: there both ranges are
    as they were (their bytes still to be copied, where a copy is what the caller wants)."""
    if not _MOVER.available:
        return [(0, length)]
    if src % _PAGE or dst % _PAGE or length % _PAGE:
        raise ValueError(f"swap_page_runs: {src:#x}, {dst:#x} and {length} must be whole pages")
    if src < dst + length and dst < src + length:
        raise ValueError(f"swap_page_runs: source {src:#x}+{length} and destination {dst:#x}+{length} overlap")
    return _split_on_failure(_MOVER.swap, src, dst, length)


def private_anonymous_ranges(maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """The address ranges of this process's private anonymous memory (the heap and anonymous
    mappings), sorted; empty where that cannot be read. Only pages there may be moved: a file's
    pages moved into a new tensor would keep it backed by the file (a shared mapping: written to it)."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or fields[1][3:4] != "p":  # perms: private, not shared
            continue
        path = fields[5].strip() if len(fields) > 5 else ""
        if path and path != "[heap]" and not path.startswith("[anon:"):  # a file, the stack, the kernel's
            continue
        lo, hi = fields[0].split("-")
        out.append((int(lo, 16), int(hi, 16)))
    out.sort()
    return _merged(out)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def within(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``[start, end)`` lies inside one of the sorted, merged ``ranges``."""
    i = bisect.bisect_right(ranges, (start, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= start and end <= ranges[i][1]


def discard_pages(start: int, end: int) -> int:
    """Hand the whole pages of ``[start, end)`` back to the OS (``madvise(MADV_DONTNEED)``); the bytes
    given back (0 where not possible). The range stays mapped: reading it gives zeros."""
    first, last = page_span(start, end)
    if not _MOVER.available or last <= first or not _MOVER.discard(first, last - first):
        return 0
    return last - first


def populate_pages(start: int, end: int) -> bool:
    """Fault in the whole pages of ``[start, end)`` for writing, as the kernel hands them out (zeroed),
    without writing them again from here (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+); ``False``
    where that is not available."""
    first, last = page_span(start, end)
    if not _MOVER.available or last <= first:
        return False
    return _MOVER.populate(first, last - first)


def untouched_runs(start: int, end: int) -> list[tuple[int, int]]:
    """The runs of whole pages inside ``[start, end)`` that are not in memory yet (never written, or
    given back), as ``(first, last)`` address pairs; empty where that cannot be read."""
    first, last = page_span(start, end)
    if not _MOVER.available or last <= first:
        return []
    vec = _MOVER.resident(first, last - first)
    if vec is None:
        return []
    # mincore sets bit 0 of a page's byte when it is in memory; the other bits are reserved (zero)
    return [(first + m.start() * _PAGE, first + m.end() * _PAGE) for m in _NOT_RESIDENT.finditer(vec)]


def _move(src: int, dst: int, length: int) -> list[tuple[int, int]]:
    """Move what can be moved; the runs that could not, as ``(offset, length)``."""
    return _split_on_failure(_MOVER.move, src, dst, length)


def _split_on_failure(call: Callable[[int, int, int], bool], src: int, dst: int, length: int) -> list[tuple[int, int]]:
    """``call`` on the whole range, else on its halves, down to ``MIN_PIECE``; the runs it failed on."""
    if call(src, dst, length):
        return []
    if length < 2 * MIN_PIECE:
        return [(0, length)]
    half = length // 2 // _PAGE * _PAGE
    rest = _split_on_failure(call, src + half, dst + half, length - half)
    return _split_on_failure(call, src, dst, half) + [(half + offset, n) for offset, n in rest]


__all__ = [
    "MIN_PIECE",
    "can_move_pages",
    "discard_pages",
    "move_pages",
    "page_span",
    "populate_pages",
    "private_anonymous_ranges",
    "swap_page_runs",
    "untouched_runs",
    "within",
]
