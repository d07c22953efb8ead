"""``StorageRecycler``: new tensors carved out of old storages, with bounded idle memory (real tensors)."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_dynatrain.devices.host.carve_buffers import CarveBuffers
from lightning_dynatrain.devices.host.page_moves import MIN_PIECE, can_move_pages, untouched_runs
from lightning_dynatrain.devices.host.recycler import ALIGNMENT, StorageRecycler, release_pages, release_tail
from lightning_dynatrain.devices.old_storage import state_group
from lightning_dynatrain.vps.spec import StateKind

MiB = 2**20
F32 = torch.float32


def _storage(mib: int, value: float = 1.0) -> torch.UntypedStorage:
    return torch.full((mib * MiB // 4,), value).untyped_storage()


def _inside(tensor: torch.Tensor, storage: torch.UntypedStorage) -> bool:
    start = tensor.data_ptr() - storage.data_ptr()
    return tensor.untyped_storage().data_ptr() == storage.data_ptr() and 0 <= start and \
        start + tensor.nbytes <= storage.nbytes()


def test_two_halves_fill_one_old_storage_without_overlap():
    recycler = StorageRecycler(idle_cap=64 * MiB)
    old = _storage(8)
    recycler.give(old, "moment")
    a = recycler.take(("w", StateKind.EXP_AVG, ()), 1 * MiB, F32, "moment")
    b = recycler.take(("w", StateKind.EXP_AVG_SQ, ()), 1 * MiB, F32, "moment")
    assert a is not None and b is not None and _inside(a, old) and _inside(b, old)
    assert a.data_ptr() + a.nbytes <= b.data_ptr() and b.data_ptr() % ALIGNMENT == 0
    a.fill_(2.0), b.fill_(3.0)
    assert torch.all(a == 2.0) and torch.all(b == 3.0)
    assert recycler.take(("w", StateKind.EXP_AVG, (1,)), 1, F32, "moment") is None  # full (and below min_bytes)
    assert recycler.reused_bytes == 8 * MiB and recycler.idle_bytes == 0


def test_groups_small_requests_and_sizes_are_respected():
    recycler = StorageRecycler(idle_cap=64 * MiB)
    recycler.give(_storage(4), "param")
    assert recycler.take(("m", StateKind.EXP_AVG, ()), MiB // 4, F32, "moment") is None  # another group
    assert recycler.take(("p", StateKind.PARAM, ()), 1000, F32, "param") is None  # below min_bytes: the heap serves it
    assert recycler.take(("p", StateKind.PARAM, ()), 2 * MiB, F32, "param") is None  # 8 MiB > the 4 MiB arena
    assert recycler.take(("p", StateKind.PARAM, ()), MiB // 2, F32, "param") is not None
    assert state_group(StateKind.EXP_AVG_SQ) == "moment" and state_group(StateKind.MAIN_PARAM) == "param"


def _pages_given_back(storage: torch.UntypedStorage) -> int:
    """Bytes of the storage's whole pages that are not in memory (``mincore``)."""
    return sum(hi - lo for lo, hi in untouched_runs(storage.data_ptr(), storage.data_ptr() + storage.nbytes()))


def _within_a_page(nbytes: int, expected: int) -> bool:
    """Arenas shrink by whole pages: what stays may be up to a page more than asked."""
    return expected <= nbytes < expected + 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and mincore are Linux")
def test_idle_storage_beyond_the_cap_goes_back_oldest_first_whole_or_by_its_end():
    recycler = StorageRecycler(idle_cap=10 * MiB)
    first, second, third, fourth = _storage(4), _storage(4), _storage(4), _storage(4)
    recycler.give(first, "param")
    recycler.give(second, "param")
    assert recycler.idle_bytes == 8 * MiB and _pages_given_back(first) == 0
    recycler.give(third, "param")  # 12 MiB idle > 10: the last 2 MiB of the oldest go back by pages
    assert _within_a_page(recycler.idle_bytes, 10 * MiB) and first.nbytes() == 4 * MiB
    assert 2 * MiB - 4096 <= _pages_given_back(first) <= 2 * MiB
    carved = recycler.take(("p", StateKind.PARAM, ()), MiB // 4, F32, "param")  # 1 MiB: the smallest room
    assert _inside(carved, first) and _within_a_page(recycler.idle_bytes, 9 * MiB)
    recycler.give(fourth, "param")  # 13 MiB: 3 go, from the oldest untouched (second), by its end
    assert _within_a_page(recycler.idle_bytes, 10 * MiB) and second.nbytes() == 4 * MiB
    assert 3 * MiB - 4096 <= _pages_given_back(second) <= 3 * MiB
    big = _storage(16)
    recycler.give(big, "param")  # 26 MiB: second (1 left), third and fourth go whole; big loses 7 by its end
    assert second.nbytes() == third.nbytes() == fourth.nbytes() == 0 and first.nbytes() > 0  # first is carved from
    assert _within_a_page(recycler.idle_bytes, 10 * MiB) and 7 * MiB - 2 * 4096 <= _pages_given_back(big) <= 7 * MiB


def test_close_frees_untouched_storages_and_keeps_carved_tensors_intact():
    recycler = StorageRecycler(idle_cap=64 * MiB)
    big, small = _storage(8), _storage(4)
    recycler.give(big, "moment")
    recycler.give(small, "moment")
    carved = recycler.take(("w", StateKind.EXP_AVG, ()), MiB // 2, F32, "moment")  # the smallest that fits
    assert _inside(carved, small)
    carved.copy_(torch.arange(carved.numel(), dtype=F32))
    rebound = {}
    recycler.close(lambda key, tensor: rebound.__setitem__(key, tensor))
    assert big.nbytes() == 0  # never carved from: freed
    assert torch.equal(carved, torch.arange(carved.numel(), dtype=F32))
    if sys.platform.startswith("linux"):  # the unused 2 MiB tail went back to the OS, the tensor stayed
        assert recycler.tail_released_bytes > 0 and not rebound
    else:  # no madvise: the tensor moved out of the half-empty storage
        assert torch.equal(rebound[("w", StateKind.EXP_AVG, ())], carved)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED) is Linux")
def test_a_range_around_a_kept_slice_is_carved_and_given_back_by_pages_never_freed():
    """The old tensor around a slice the new state keeps (``give_range``): new tensors are carved
    inside the range only, and what is left of it goes back by pages, the kept slice intact."""
    recycler = StorageRecycler(idle_cap=64 * MiB)
    old = _storage(8, value=5.0)
    values = torch.empty(0).set_(old, 0, (old.nbytes() // 4,))
    kept = values[: 2 * MiB // 4]  # the first 2 MiB stay: the new state's slice
    assert recycler.give_range(old, kept.nbytes + 4, old.nbytes(), "param") == 0  # start rounds up to ALIGNMENT
    assert recycler.take_whole(MiB // 4, F32, "param") is None  # a range is never a whole buffer
    a = recycler.take(("p", StateKind.PARAM, (0,)), 3 * MiB // 4, F32, "param")
    assert a is not None and _inside(a, old) and a.data_ptr() == old.data_ptr() + kept.nbytes + ALIGNMENT
    assert recycler.take(("p", StateKind.PARAM, (1,)), 3 * MiB // 4, F32, "param") is None  # 6 MiB - 64 B left
    a.fill_(2.0)
    recycler.close(lambda key, tensor: None)
    assert old.nbytes() == 8 * MiB  # the storage lives on with the kept slice
    assert torch.all(kept == 5.0) and torch.all(a == 2.0)
    assert 3 * MiB - 2 * 4096 <= recycler.tail_released_bytes <= 3 * MiB  # past the carved tensor, by pages
    page = 4096 // 4
    assert torch.all(values[-2 * MiB // 4: -page] == 0.0)  # released pages read as fresh zeros

    small = StorageRecycler(idle_cap=0)  # an idle range beyond the cap goes back by pages too
    other = _storage(4, value=5.0)
    assert small.give_range(other, 0, 2 * MiB, "param") == 0 and other.nbytes() == 4 * MiB
    rest = torch.empty(0).set_(other, 0, (other.nbytes() // 4,))
    assert torch.all(rest[page: 2 * MiB // 4 - page] == 0.0) and torch.all(rest[2 * MiB // 4:] == 5.0)
    # below min_bytes: its whole pages at once (the storage need not start on a page)
    assert 7 * 4096 <= small.give_range(other, 2 * MiB, 2 * MiB + 8 * 4096, "param") <= 8 * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED) is Linux")
def test_a_released_tail_reads_as_zeros_and_the_head_is_kept():
    storage = _storage(4, value=7.0)
    released = release_tail(storage, MiB)
    assert 3 * MiB - 2 * 4096 <= released <= 3 * MiB  # the whole pages from byte 1 MiB on
    values = torch.empty(0).set_(storage, 0, (storage.nbytes() // 4,))
    page = 4096 // 4
    assert torch.all(values[: MiB // 4] == 7.0)  # the head is untouched
    assert torch.all(values[MiB // 4 + page: -page] == 0.0)  # the released pages read as fresh zeros


def test_torch_zeros_inside_carve_buffers_takes_a_whole_old_storage():
    """megatron's DDP allocates its buffers with ``torch.zeros``: inside ``CarveBuffers`` they land at the
    start of an old gradient buffer (zeroed, alone in it), else in fresh memory as usual."""
    recycler = StorageRecycler(idle_cap=0)
    old_grads = _storage(8, value=5.0)
    recycler.give(old_grads, "buffer", hold=True)  # held: not freed by the (zero) idle cap
    assert old_grads.nbytes() > 0
    spare = _storage(2)
    recycler.give(spare, "buffer", hold=True)
    with CarveBuffers(recycler, "buffer"):
        grad = torch.zeros(MiB, dtype=F32, requires_grad=False)  # 4 MiB: the smallest that fits is the 8
        assert spare.nbytes() > 0
        # fits no held storage: their pages go into it, then they are freed (40 MiB: the heap's
        # allocator maps it anew, never hands out memory touched before)
        fresh = torch.zeros(10 * MiB, dtype=F32)
        assert spare.nbytes() == 0
        small = torch.zeros(16)
    assert _inside(grad, old_grads) and grad.data_ptr() == old_grads.data_ptr() and torch.all(grad == 0)
    assert not _inside(fresh, old_grads) and torch.all(fresh == 0) and torch.all(small == 0)
    assert recycler.reused_bytes == 4 * MiB
    if can_move_pages():  # the spare's 2 MiB of pages went into the buffer that fits nothing
        assert 2 * MiB - MIN_PIECE <= recycler.moved_in_bytes <= 2 * MiB


def test_carve_buffers_without_zeroing_hands_over_the_old_bytes():
    """``zero=False`` (megatron's DDP buffers in a switch: written before read) skips the zeroing
    pass: the buffer is the old storage, bytes and all; a buffer that fits nothing is still zeros."""
    recycler = StorageRecycler(idle_cap=0)
    old_grads = _storage(8, value=5.0)
    recycler.give(old_grads, "buffer", hold=True)
    with CarveBuffers(recycler, "buffer", zero=False):
        grad = torch.zeros(MiB, dtype=F32)
        fresh = torch.zeros(4 * MiB, dtype=F32)  # fits no held storage
    assert grad.data_ptr() == old_grads.data_ptr() and torch.all(grad == 5.0)
    assert not _inside(fresh, old_grads) and torch.all(fresh == 0)


def test_carve_buffers_skipping_copies_leaves_the_copied_buffer_to_its_writer():
    """``skip_copies`` (a switch's new model: uninitialised params the engine writes later): megatron's
    copy of each param into the zero1 param buffer is skipped, so that buffer is left as served
    (fresh: untouched; carved: the old bytes); a fresh buffer no copy targeted (a gradient buffer)
    is in memory once ``fault_in_untouched`` ran; copies into other tensors still happen."""
    recycler = StorageRecycler(idle_cap=0)
    old_grads = _storage(8, value=5.0)
    recycler.give(old_grads, "buffer", hold=True)
    params = [torch.full((MiB // 2,), 3.0), torch.full((MiB // 2,), 4.0)]
    elsewhere = torch.zeros(16)
    with CarveBuffers(recycler, "buffer", zero=False, skip_copies=True) as carve:
        carved_param_buffer = torch.zeros(MiB, dtype=F32)  # fits the old gradients: carved
        fresh_param_buffer = torch.zeros(4 * MiB, dtype=F32)  # fits nothing: fresh
        fresh_grad_buffer = torch.zeros(4 * MiB, dtype=F32)
        for i, param in enumerate(params):
            carved_param_buffer[i * MiB // 2:(i + 1) * MiB // 2].copy_(param)  # as megatron's DDP does
            fresh_param_buffer[i * MiB // 2:(i + 1) * MiB // 2].detach().copy_(param)
        elsewhere.copy_(torch.ones(16))
    release_pages(fresh_grad_buffer.device, fresh_grad_buffer.data_ptr(),  # the heap may reuse touched memory
                  fresh_grad_buffer.data_ptr() + fresh_grad_buffer.nbytes)
    assert carve.fault_in_untouched() == fresh_grad_buffer.nbytes
    if can_move_pages():  # every whole page of it is in memory now, as the kernel zeroed it
        assert not untouched_runs(fresh_grad_buffer.data_ptr(), fresh_grad_buffer.data_ptr() + fresh_grad_buffer.nbytes)
    assert carved_param_buffer.data_ptr() == old_grads.data_ptr() and torch.all(carved_param_buffer == 5.0)
    for i, param in enumerate(params):  # never written (what it holds is the allocator's): the copies were skipped
        assert not torch.equal(fresh_param_buffer[i * MiB // 2:(i + 1) * MiB // 2], param)
    assert torch.all(elsewhere == 1.0)
    assert carve.skipped_copy_bytes == 4 * params[0].nbytes


@pytest.mark.skipif(not (sys.platform.startswith("linux") and can_move_pages()), reason="mremap is Linux")
def test_an_untouched_buffer_takes_the_pages_of_idle_old_storage():
    """``fault_in_untouched`` moves the pages of old storage held idle (up to the bytes reserved for
    the buffers) into a fresh gradient buffer: memory already touched, not fresh. They keep the old
    bytes (megatron zeroes a gradient buffer before its first use): no pass over them here."""
    recycler = StorageRecycler(idle_cap=0)
    with CarveBuffers(recycler, "buffer", zero=False, skip_copies=True) as carve:
        grads = torch.zeros(2 * MiB, dtype=F32)  # 8 MiB, nothing held for it: fresh, untouched
    release_pages(grads.device, grads.data_ptr(), grads.data_ptr() + grads.nbytes)  # the heap may reuse touched memory
    assert grads.nbytes - 2 * 4096 <= carve.untouched_bytes <= grads.nbytes  # its whole pages, none in memory
    recycler.reserve(carve.untouched_bytes)
    old = _storage(12, value=5.0)
    recycler.give(old, "moment")  # 12 MiB idle > the 8 reserved: 4 go back at once
    assert old.nbytes() > 0 and recycler.idle_bytes < 8 * MiB + 4096
    assert carve.fault_in_untouched() == grads.nbytes
    moved = recycler.moved_in_bytes
    assert grads.nbytes - MIN_PIECE - 2 * 4096 <= moved <= grads.nbytes
    assert not untouched_runs(grads.data_ptr(), grads.data_ptr() + grads.nbytes)  # the rest faulted in
    first = (-grads.data_ptr() % 4096) // 4  # the buffer's first whole page
    assert torch.all(grads[first: first + (moved - 4096) // 4] == 5.0)  # the old pages, as they were
    values = torch.empty(0).set_(old, 0, (old.nbytes() // 4,))
    assert torch.all(values[4096 // 4: recycler.moved_in_bytes // 4] == 0.0)  # its pages went to the buffer
