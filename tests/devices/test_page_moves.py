"""Moving old storages' pages into new tensors (``page_moves``, ``StorageRecycler.fill``): real memory,
checked page by page with ``mincore`` and by the values the moved pages carry."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_dynatrain.devices.host.page_moves import (
    MIN_PIECE,
    can_move_pages,
    move_pages,
    page_span,
    populate_pages,
    private_anonymous_ranges,
    swap_page_runs,
    untouched_runs,
    within,
)
from lightning_dynatrain.devices.host.recycler import StorageRecycler, release_pages

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and can_move_pages()),
                                reason="mremap and mincore are Linux")

MiB = 2**20
PAGE = 4096
F32 = torch.float32


def _not_resident(tensor: torch.Tensor) -> int:
    return sum(hi - lo for lo, hi in untouched_runs(tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes))


def _fresh(numel: int) -> torch.Tensor:
    """A tensor none of whose whole pages are in memory (the heap may hand out memory touched before)."""
    tensor = torch.empty(numel)
    release_pages(tensor.device, tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes)
    return tensor


def _mappings(tensor: torch.Tensor) -> int:
    """How many of this process's memory mappings (``/proc/self/maps``) the tensor's bytes touch."""
    lo, hi = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    with open("/proc/self/maps") as maps:
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in maps]
    return sum(start < hi and lo < end for start, end in spans)


def _whole_pages(tensor: torch.Tensor) -> torch.Tensor:
    """The elements of ``tensor`` that lie in its whole pages."""
    first, last = page_span(tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes)
    lo = (first - tensor.data_ptr()) // tensor.element_size()
    return tensor[lo: lo + (last - first) // tensor.element_size()]


def test_moved_pages_carry_their_bytes_and_the_source_stays_readable_as_zeros():
    old = torch.full((4 * MiB,), 7.0)  # 16 MiB, touched
    new = _fresh(3 * MiB)  # 12 MiB, not in memory
    assert _not_resident(new) >= new.nbytes - 2 * PAGE
    moved = move_pages(old.data_ptr(), old.data_ptr() + old.nbytes, new.data_ptr(), new.data_ptr() + new.nbytes)
    assert new.nbytes - 2 * PAGE <= moved <= new.nbytes
    assert _not_resident(new) == 0 and torch.all(_whole_pages(new) == 7.0)  # the old pages, not fresh zeros
    assert torch.all(_whole_pages(old)[: moved // 4] == 0.0)  # still mapped: reads as fresh memory
    assert torch.all(old[-MiB:] == 7.0)  # past what moved: untouched
    new.copy_(torch.arange(new.numel(), dtype=F32))  # the new tensor is ordinary memory
    assert torch.equal(new, torch.arange(new.numel(), dtype=F32))
    old.fill_(1.0)  # so is the old one, and both are freed as usual
    assert torch.all(old == 1.0)
    with pytest.raises(ValueError, match="overlap"):
        move_pages(old.data_ptr(), old.data_ptr() + 8 * MiB, old.data_ptr() + 4 * MiB, old.data_ptr() + 12 * MiB)


def test_fill_takes_fragments_of_several_old_storages_and_skips_pages_in_memory():
    recycler = StorageRecycler(idle_cap=64 * MiB)
    a, b = torch.full((MiB,), 1.0), torch.full((MiB,), 2.0)  # 4 MiB each
    recycler.give(a.untyped_storage(), "param")
    recycler.give(b.untyped_storage(), "moment")  # pages move across groups: the new tensor owns them
    new = _fresh(7 * MiB // 4)  # 7 MiB: no single old storage holds it (``take`` could not)
    assert recycler.take(("p", None, ()), new.numel(), F32, "param") is None
    moved = recycler.fill(new)
    assert 7 * MiB - 3 * PAGE <= moved <= 7 * MiB and _not_resident(new) == 0
    values = set(_whole_pages(new).unique().tolist())
    assert values == {1.0, 2.0}  # pages of both old storages
    assert recycler.moved_in_bytes == moved and recycler.idle_bytes <= 8 * MiB - moved
    touched = torch.zeros(2 * MiB)  # all in memory: nothing to move into
    assert recycler.fill(touched) == 0 and torch.all(touched == 0.0)
    recycler.close(lambda key, tensor: None)
    assert a.untyped_storage().nbytes() == 0 and b.untyped_storage().nbytes() == 0  # freed as usual
    new.fill_(3.0)
    assert torch.all(new == 3.0)


def test_memory_made_of_moved_pages_can_be_moved_again():
    """A tensor filled from several old storages spans several mappings; ``mremap`` moves within one
    only, so moving out of it goes piece by piece (halving where a piece spans two)."""
    parts = [torch.full((MiB,), float(i)) for i in range(4)]  # 4 MiB each
    first = StorageRecycler(idle_cap=64 * MiB)
    for part in parts:
        first.give(part.untyped_storage(), "param")
    middle = _fresh(15 * MiB // 4)
    assert first.fill(middle) >= 15 * MiB - 8 * PAGE
    assert _mappings(middle) > 1  # the case this test is about
    values = _whole_pages(middle).clone()
    second = StorageRecycler(idle_cap=64 * MiB)
    second.give(middle.untyped_storage(), "param")
    last = _fresh(15 * MiB // 4)
    moved = second.fill(last)
    assert moved >= 15 * MiB - 8 * PAGE - 3 * 2 * MIN_PIECE  # at most two pieces lost per boundary
    assert _not_resident(last) <= last.nbytes - moved + 2 * PAGE
    got = _whole_pages(last)  # both start at a page: element i of each is the same byte of the same page
    n = min(got.numel(), values.numel())
    assert (got[:n] == values[:n]).float().mean().item() >= moved / last.nbytes - 0.01


def test_pages_of_a_file_mapped_into_memory_are_never_moved(tmp_path):
    """A storage mapped from a file (a checkpoint loaded with ``torch.load(mmap=True)``; here a shared
    mapping, where new state written into it would be written to the file) gives no pages and is
    never carved from: the new tensor takes fresh pages and the file keeps its bytes."""
    path = tmp_path / "state.bin"
    path.write_bytes(torch.full((2 * MiB,), 5.0).numpy().tobytes())  # 8 MiB
    mapped = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=8 * MiB)
    anonymous = private_anonymous_ranges()
    assert not within(anonymous, mapped.data_ptr(), mapped.data_ptr() + mapped.nbytes())
    plain = torch.empty(MiB)
    assert within(anonymous, plain.data_ptr(), plain.data_ptr() + plain.nbytes)
    recycler = StorageRecycler(idle_cap=64 * MiB)
    recycler.give(mapped, "moment")
    recycler.give_range(mapped, 0, 4 * MiB, "moment")  # nor a range of it
    new = _fresh(MiB)
    assert recycler.fill(new) == 0 and _not_resident(new) >= new.nbytes - 2 * PAGE
    assert recycler.take(("m", None, ()), MiB // 4, F32, "moment") is None  # and nothing is carved from it
    new.fill_(1.0)
    recycler.close(lambda key, tensor: None)
    assert torch.all(torch.frombuffer(bytearray(path.read_bytes()), dtype=F32) == 5.0)


def test_populated_pages_are_in_memory_and_zero():
    """``populate_pages`` faults pages in as the kernel hands them out, without a pass over them;
    where the kernel cannot (before 5.14) it says so and nothing changes."""
    tensor = _fresh(2 * MiB)  # 8 MiB, not in memory
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    if not populate_pages(start, end):
        assert _not_resident(tensor) >= tensor.nbytes - 2 * PAGE
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    assert _not_resident(tensor) == 0 and torch.all(_whole_pages(tensor) == 0.0)


def _at_page_offset(numel: int, offset: int, value: float) -> torch.Tensor:
    """A ``numel``-element tensor of ``value`` starting ``offset`` bytes past a page boundary."""
    room = torch.empty(numel + (2 * PAGE) // 4)
    skip = (-room.data_ptr() % PAGE + offset) // 4
    return room[skip: skip + numel].fill_(value)


def test_swapped_pages_change_places_and_bad_ranges_are_refused():
    a, b = _at_page_offset(MiB, 0, 1.0), _at_page_offset(MiB, 0, 2.0)  # 4 MiB each, page-aligned
    assert swap_page_runs(a.data_ptr(), b.data_ptr(), a.nbytes) == []
    assert torch.all(a == 2.0) and torch.all(b == 1.0)
    with pytest.raises(ValueError, match="whole pages"):
        swap_page_runs(a.data_ptr() + 4, b.data_ptr(), a.nbytes - PAGE)
    with pytest.raises(ValueError, match="overlap"):
        swap_page_runs(a.data_ptr(), a.data_ptr() + PAGE, 2 * PAGE)


@pytest.mark.parametrize("offset", [0, 1028])
def test_a_copy_by_pages_is_exact_and_leaves_the_source_the_old_destination_pages(offset):
    """``StorageRecycler.copy_by_pages``: the destination gets the source's values (its whole pages by
    an exchange, the bytes around them by a copy); the source's whole pages then hold what the
    destination had, memory already in use: no fresh page either side."""
    recycler = StorageRecycler(idle_cap=0)
    src = _at_page_offset(MiB + 5, offset, 0.0).copy_(torch.arange(MiB + 5, dtype=F32))
    dst = _at_page_offset(MiB + 5, offset, -1.0)
    expected = src.clone()
    moved = recycler.copy_by_pages(dst, src)
    first, last = page_span(src.data_ptr(), src.data_ptr() + src.nbytes)
    assert moved == last - first == recycler.copied_by_pages_bytes and torch.equal(dst, expected)
    assert torch.all(_whole_pages(src) == -1.0) and _not_resident(src) == _not_resident(dst) == 0


def test_a_copy_by_pages_declines_what_it_cannot_do_and_writes_nothing():
    recycler = StorageRecycler(idle_cap=0)
    src = _at_page_offset(MiB, 0, 3.0)
    for dst in (_at_page_offset(MiB, 64, 0.0),  # another offset in a page
                _at_page_offset(MiB, 0, 0.0).view(1024, 1024).t(),  # not contiguous
                _at_page_offset(MiB, 0, 0.0).to(torch.float64)):  # another dtype
        assert recycler.copy_by_pages(dst, src.view_as(dst) if dst.dtype == F32 else src) is None
        assert torch.all(dst == 0.0)
    small = _at_page_offset(1024, 0, 0.0)  # below ``min_bytes``
    assert recycler.copy_by_pages(small, src[:1024]) is None and torch.all(small == 0.0)
    assert recycler.copy_by_pages(src[PAGE // 4: PAGE // 4 + MiB // 2], src[:MiB // 2]) is None  # overlapping
    assert torch.all(src == 3.0) and recycler.copied_by_pages_bytes == 0
