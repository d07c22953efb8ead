"""Writing a switch's new state into memory its old state already touched (for CPU memory).

On CPU, the first write to a fresh tensor faults its pages in and the kernel zeroes each one, which
makes writing new state into fresh memory slower than writing into touched memory
(``benchmarks/fresh_memory.py``). An accelerator's caching allocator reuses freed blocks by itself. PyTorch's CPU allocator hands
large blocks back to the OS, so ``StorageRecycler`` keeps the storages the switch is done with
(``give``) and carves new local tensors out of them (``take``).

The same goes for buffers built inside library code: a whole old storage held for them
(``give(..., hold=True)``: the old gradient buffers) serves them (``take_whole``), with no fresh
pages (megatron's DDP buffers: ``carve_buffers.CarveBuffers``).

A new tensor that fits no free run of one old storage, or one that must keep its own storage (a
buffer megatron built, a tensor that cannot be rebound), takes old memory by its pages instead:
``fill`` moves the pages of idle arenas into those of its pages not in memory yet
(``page_moves``, Linux ``mremap``; no copy). A buffer that stays untouched until the end of the
switch (a gradient buffer no old one could hold) has idle old storage held for it (``reserve``) and
filled at the end.

Rules that keep memory bounded:

- An arena serves one group of state kinds (``"param"`` or ``"moment"``), so a later switch that
  keeps one arena's tensors in place keeps all of them or none.
- Requests below ``min_bytes`` are not recycled: the heap serves small tensors without page faults.
- The arena space nobody has carved from ("idle") never exceeds ``idle_cap`` plus the reserved
  bytes (to a page) while untouched arenas remain: they are freed, oldest first, and the one that
  is larger than the excess gives back only its end, by pages. The reserved bytes are for buffers
  the memory bound counts already and that take no memory until they are filled.
- A range of a storage the new state keeps a tensor in (``give_range``: the old tensor around a
  slice kept in place) is never freed as a storage: what is not carved from it goes back by pages.
- ``close`` frees arenas never carved from, and gives the unused tail of the others back to the OS
  (``madvise(MADV_DONTNEED)`` on its whole pages: the carved tensors stay where they are). Where
  that call is not available, tensors are moved out of arenas left with more than 1/16 of their
  space unused (a copy into fresh memory, rebound through the callback). Either way no arena
  outlives the switch holding memory nobody uses.

Example::

    recycler = StorageRecycler(idle_cap=256 * 2**20)
    recycler.give(old_tensor.untyped_storage(), "moment")   # the engine is done with it
    new = recycler.take(key, numel, torch.float32, "moment")  # a view into it, or None
    recycler.close(rebind)                                    # at the end of the switch
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightning_dynatrain.devices.host.page_moves import (
    MIN_PIECE,
    can_move_pages,
    discard_pages,
    move_pages,
    page_span,
    private_anonymous_ranges,
    swap_page_runs,
    untouched_runs,
    within,
)
from lightning_dynatrain.transition.program import StoreKey
from lightning_dynatrain.devices.old_storage import free_storage

MiB = 2**20
#: the group of memory only ``fill`` takes (by its pages), never carved: the tail of an old gradient
#: buffer a new DDP buffer lives in, a staging buffer
PAGES_GROUP = "pages"
#: carved tensors start at a multiple of this many bytes (any dtype can view them; cache lines stay whole)
ALIGNMENT = 64


@dataclass(eq=False)
class _Arena:
    """Bytes ``[start, end)`` of an old storage, carved from ``start`` up (``used``: the next free byte).
    A whole storage, or the part of one around a tensor the new state keeps in it (``give_range``)."""

    storage: torch.UntypedStorage
    group: str
    start: int = 0
    end: int = -1  # -1: the storage's end
    used: int = -1  # -1: ``start``
    carved: list[tuple[StoreKey, torch.Tensor]] = field(default_factory=list)
    owns_storage: bool = False
    """Nothing else lives in the storage: it is freed with the arena (``give``); else only the
    range's pages go back (``give_range``)."""
    movable: bool = False
    """Its pages may be moved into new tensors (``fill``): private anonymous memory, not pinned."""

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = self.storage.nbytes()
        if self.used < 0:
            self.used = self.start

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def room(self) -> int:
        return self.end - self.used

    @property
    def untouched(self) -> bool:
        return self.used == self.start

    @property
    def whole(self) -> bool:
        """The arena is its whole storage (nothing else lives in it, no page of it given back)."""
        return self.owns_storage and self.start == 0 and self.end == self.storage.nbytes()

    def discard(self) -> None:
        """Give back an arena nothing was carved from: the storage, or the range's pages."""
        if self.owns_storage:
            free_storage(self.storage)
        else:
            self._release_from(self.start)

    def trim(self, nbytes: int) -> int:
        """Give back (by pages) up to ``nbytes`` at the end of the arena's free room; the bytes it shrank by."""
        base = self.storage.data_ptr()
        cut = max(self.used, page_span(base + self.end - nbytes, base + self.end)[0] - base)  # a page boundary
        if cut >= self.end:
            return 0
        release_pages(self.storage.device, base + cut, base + self.end)
        shrunk, self.end = self.end - cut, cut
        return shrunk

    def release_rest(self) -> int:
        """Give the pages past the carved tensors back to the OS; the bytes released."""
        return self._release_from(self.used)

    def _release_from(self, offset: int) -> int:
        base = self.storage.data_ptr()
        return release_pages(self.storage.device, base + offset, base + self.end)


def _own_cpu_memory(storage: torch.UntypedStorage) -> bool:
    """CPU memory from PyTorch's allocator, which new state may be written into. A storage that
    cannot be resized is someone else's (a file mapped into memory, where a write would reach the
    file; memory borrowed from another library): never carved from."""
    return storage.device.type == "cpu" and storage.resizable()


def release_pages(device: torch.device, start: int, end: int) -> int:
    """Hand the whole pages between addresses ``start`` and ``end`` of CPU memory back to the OS;
    the bytes released (0 where not possible). The memory stays mapped: a later write there gets
    fresh zeroed pages. Only for memory nothing will read again."""
    return discard_pages(start, end) if device.type == "cpu" else 0


def release_tail(storage: torch.UntypedStorage, start: int) -> int:
    """``release_pages`` of ``storage`` from byte ``start`` to its end."""
    return release_pages(storage.device, storage.data_ptr() + start, storage.data_ptr() + storage.nbytes())


class StorageRecycler:
    """Old storages given back during one switch, carved into its new local tensors. One per switch."""

    def __init__(self, *, idle_cap: int, min_bytes: int = MiB) -> None:
        self.idle_cap = idle_cap
        self.min_bytes = min_bytes
        self._arenas: dict[str, list[_Arena]] = {}  # per group, oldest first
        self._idle_order: list[_Arena] = []  # arenas given, oldest first (those carved from are skipped)
        self.idle_bytes = 0
        self.given_bytes = 0
        self.reused_bytes = 0
        self.tail_released_bytes = 0
        self.moved_out_bytes = 0
        self.moved_in_bytes = 0
        self.copied_by_pages_bytes = 0
        self.reserved_bytes = 0
        # the memory old storages may give pages from (the process's maps, read again only for a
        # storage mapped since)
        self._anonymous = private_anonymous_ranges() if can_move_pages() else []

    def give(self, storage: torch.UntypedStorage, group: str, *, hold: bool = False) -> None:
        """Take over an old storage the switch no longer reads. ``hold``: keep it, outside the idle cap,
        until ``drop_group`` (memory that is about to be replaced by as much, e.g. gradient buffers)."""
        self._take_whole_storage(storage, group, hold, lambda: self._movable(storage, 0, storage.nbytes()))

    def give_range(self, storage: torch.UntypedStorage, start: int, end: int, group: str) -> int:
        """Take over bytes ``[start, end)`` of a storage the new state keeps other tensors in (the
        parts of an old tensor around a slice kept in place, ``transition.adoption.slice_keys``). What is
        not carved from it goes back to the OS by its pages (``release_pages``), never by freeing
        the storage. Returns the bytes given back at once: all of them below ``min_bytes`` (or off
        the CPU), else 0."""
        start = -(-start // ALIGNMENT) * ALIGNMENT
        if end - start < self.min_bytes or not _own_cpu_memory(storage):
            return release_pages(storage.device, storage.data_ptr() + start, storage.data_ptr() + end)
        self.given_bytes += end - start
        self._add(_Arena(storage, group, start, end, movable=self._movable(storage, start, end)), hold=False)
        return 0

    def _movable(self, storage: torch.UntypedStorage, start: int, end: int) -> bool:
        if not can_move_pages() or storage.is_pinned():
            return False
        lo, hi = storage.data_ptr() + start, storage.data_ptr() + end
        if not within(self._anonymous, lo, hi):
            self._anonymous = private_anonymous_ranges()
        return within(self._anonymous, lo, hi)

    def _add(self, arena: _Arena, *, hold: bool) -> None:
        self._arenas.setdefault(arena.group, []).append(arena)
        if hold:
            return
        self._idle_order.append(arena)
        self.idle_bytes += arena.size
        for oldest in [a for a in self._idle_order if a.untouched]:  # give back untouched arenas, oldest first
            excess = self.idle_bytes - self.idle_cap - self.reserved_bytes
            if excess <= 0:
                break
            if oldest.size > excess:  # larger than the excess: only its end goes back
                self.idle_bytes -= oldest.trim(excess)
                continue
            self._idle_order.remove(oldest)
            self._arenas[oldest.group].remove(oldest)
            self.idle_bytes -= oldest.size
            oldest.discard()

    def take(self, key: StoreKey, numel: int, dtype: torch.dtype, group: str) -> torch.Tensor | None:
        """A contiguous ``numel``-element tensor carved from an old storage of ``group``, or ``None``."""
        nbytes = numel * dtype.itemsize
        if nbytes < self.min_bytes:
            return None
        fits = [a for a in self._arenas.get(group, ()) if a.room >= nbytes]
        if not fits:
            return None
        # fill arenas already in use first, then the smallest idle one that fits
        arena = min(fits, key=lambda a: (a.untouched, a.room))
        offset = arena.used
        tensor = torch.empty(0, dtype=dtype, device=arena.storage.device)
        tensor.set_(arena.storage, offset // dtype.itemsize, (numel,))
        end = min(arena.end, offset + -(-nbytes // ALIGNMENT) * ALIGNMENT)
        self.idle_bytes -= end - offset
        arena.used = end
        arena.carved.append((key, tensor))
        self.reused_bytes += nbytes
        return tensor

    def take_whole(self, numel: int, dtype: torch.dtype, group: str) -> torch.Tensor | None:
        """A tensor at the start of the smallest untouched storage of ``group`` that fits, alone in it:
        the rest of that storage is handed back to the OS at once (``release_tail``). For buffers
        that are later freed by their storage (megatron's DDP buffers), so nothing else may share it."""
        nbytes = numel * dtype.itemsize
        fits = [a for a in self._arenas.get(group, ()) if a.whole and a.untouched and a.size >= nbytes]
        if nbytes < self.min_bytes or not fits:
            return None
        arena = min(fits, key=lambda a: a.size)
        tensor = torch.empty(0, dtype=dtype, device=arena.storage.device).set_(arena.storage, 0, (numel,))
        tail = -(-nbytes // ALIGNMENT) * ALIGNMENT
        if arena.size - tail >= self.min_bytes:  # idle, for ``fill`` only: the storage is the buffer's
            self._add(_Arena(arena.storage, PAGES_GROUP, tail, arena.size, movable=arena.movable), hold=False)
        else:
            release_tail(arena.storage, nbytes)
        if arena in self._idle_order:
            self._idle_order.remove(arena)
            self.idle_bytes -= arena.size
        arena.used = arena.size
        self._arenas[group].remove(arena)  # nothing more is carved from it
        self.reused_bytes += nbytes
        return tensor

    def give_pages(self, tensor: torch.Tensor) -> None:
        """Take over ``tensor``, alone in its storage, which the switch is done with (a staging buffer
        it allocated), for ``fill`` only: its storage is never carved."""
        storage = tensor.untyped_storage()  # PyTorch's own memory: no need to read the maps for it
        self._take_whole_storage(storage, PAGES_GROUP, False, lambda: can_move_pages() and not storage.is_pinned())

    def _take_whole_storage(self, storage: torch.UntypedStorage, group: str, hold: bool,
                            movable: Callable[[], bool]) -> None:
        self.given_bytes += storage.nbytes()
        if storage.nbytes() < self.min_bytes or not _own_cpu_memory(storage):
            free_storage(storage)
            return
        self._add(_Arena(storage, group, owns_storage=True, movable=movable()), hold=hold)

    def reserve(self, nbytes: int) -> None:
        """Hold up to ``nbytes`` more of idle old storage for ``fill``: for buffers that stay untouched
        until the end of the switch (and whose memory the switch's memory bound counts already)."""
        self.reserved_bytes += nbytes

    def fill(self, tensor: torch.Tensor, group: str | None = None) -> int:
        """Move the pages of idle old storage into the whole pages of ``tensor`` that are not in
        memory yet (``page_moves``): they are then memory already touched instead of fresh pages,
        and ``tensor`` keeps its own storage. Every element of ``tensor`` must be written before it
        is read (it holds old bytes after this). Takes from arenas already carved from first
        (fragments ``take`` cannot serve), then from the smallest; ``group``: from its arenas only.
        The bytes moved."""
        if not can_move_pages() or tensor.device.type != "cpu" or tensor.nbytes < self.min_bytes \
                or tensor.is_pinned():
            return 0
        moved = 0
        for start, end in untouched_runs(tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes):
            moved += self._fill_pages(start, end, group)
        self.moved_in_bytes += moved
        return moved

    def _fill_pages(self, dst: int, dst_end: int, group: str | None) -> int:
        arenas = self._arenas.get(group, []) if group is not None else [a for g in self._arenas.values() for a in g]
        sources = [a for a in arenas if a.movable and a.room >= MIN_PIECE]
        sources.sort(key=lambda a: (a.untouched, a.room))
        moved = 0
        for arena in sources:
            if dst_end - dst < MIN_PIECE:
                break
            base = arena.storage.data_ptr()
            first, last = page_span(base + arena.used, base + arena.end)
            length = min(last - first, dst_end - dst)
            if length < MIN_PIECE:
                continue
            done = move_pages(first, first + length, dst, dst + length)
            if done < length:  # pieces that could not move: their pages go back, not kept unused
                release_pages(arena.storage.device, first, first + length)
            consumed = first + length - base - arena.used
            arena.used += consumed
            if arena in self._idle_order:
                self.idle_bytes -= consumed
            dst += length
            moved += done
        return moved

    def copy_by_pages(self, dst: torch.Tensor, src: torch.Tensor) -> int | None:
        """Copy ``src`` into ``dst`` (same dtype and shape, contiguous CPU tensors) by exchanging the
        whole pages between them instead of copying their bytes, where the two lie at the same offset
        in a page (``page_moves.swap_page_runs``): only the bytes before the first and after the last
        whole page, and any run ``mremap`` refused, are copied. For the last read of ``src``: its
        memory there then holds ``dst``'s old bytes (and pages, memory already touched that goes
        wherever ``src``'s storage goes next). The bytes moved, or ``None`` (nothing written) where
        this does not apply: below ``min_bytes``, offsets that differ within a page, memory that is
        not the process's own private anonymous memory, pinned memory, overlapping tensors."""
        nbytes = src.nbytes
        if nbytes < self.min_bytes or not can_move_pages() or src.device.type != "cpu" or dst.device.type != "cpu" \
                or src.dtype != dst.dtype or src.shape != dst.shape or not (src.is_contiguous() and dst.is_contiguous()):
            return None
        src_at, dst_at = src.data_ptr(), dst.data_ptr()
        first, last = page_span(src_at, src_at + nbytes)
        head = first - src_at  # bytes before the first whole page: the same in both, or no page lines up
        if last - first < MIN_PIECE or page_span(dst_at, dst_at + nbytes)[0] - dst_at != head \
                or src_at < dst_at + nbytes and dst_at < src_at + nbytes:
            return None
        src_storage = src.untyped_storage()
        offset = src_at - src_storage.data_ptr()
        if dst.is_pinned() or not _own_cpu_memory(dst.untyped_storage()) \
                or not self._movable(src_storage, offset, offset + nbytes):  # pinned or not ours: not movable
            return None
        src_bytes, dst_bytes = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
        runs = [(0, head), (last - src_at, nbytes - (last - src_at))]
        runs += [(head + offset, n) for offset, n in swap_page_runs(first, dst_at + head, last - first)]
        for offset, n in runs:
            dst_bytes[offset:offset + n].copy_(src_bytes[offset:offset + n])
        moved = last - first - sum(n for _, n in runs[2:])
        self.copied_by_pages_bytes += moved
        return moved

    def drop_group(self, group: str) -> None:
        """Free what is left untouched of ``group``'s storages."""
        for arena in self._arenas.pop(group, []):
            if arena in self._idle_order:
                self._idle_order.remove(arena)
                self.idle_bytes -= arena.room
            if not arena.carved:
                arena.discard()
            elif arena.room > 0:
                self.tail_released_bytes += arena.release_rest()

    def close(self, rebind: Callable[[StoreKey, torch.Tensor], None]) -> None:
        """End of the switch: free idle arenas, and the unused tails of the others (see the module)."""
        for arena in (a for arenas in self._arenas.values() for a in arenas):
            if not arena.carved:
                arena.discard()
            elif arena.room > 0 and (released := arena.release_rest()):
                self.tail_released_bytes += released
            elif arena.room > max(self.min_bytes, arena.size // 16):
                for key, tensor in arena.carved:
                    fresh = torch.empty_like(tensor)
                    fresh.copy_(tensor)
                    rebind(key, fresh)
                    self.moved_out_bytes += fresh.nbytes
                # not freed here: the engine's store may still view it until the switch returns
        self._arenas.clear()
        self._idle_order.clear()
        self.idle_bytes = 0


__all__ = ["ALIGNMENT", "PAGES_GROUP", "StorageRecycler", "release_pages", "release_tail"]
