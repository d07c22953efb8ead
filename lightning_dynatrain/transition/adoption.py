"""Keeping retained state in place: which destination local tensors can simply *be* the source ones.

A destination local tensor can take over its source tensor's storage, with no copy and no new
allocation, when

- the plan retains every element of it (nothing is received into it, nothing filled), and
- the same key has the same local layout in both layouts (origin, local shape, and for a zero1
  shard the same flat range), so every element sits at the same offset before and after.

That is common: a pipeline change keeps whole layers on the ranks that held them, turning zero1 on
keeps every parameter, and a data-parallel change keeps every rank's tensor-parallel shard.

It can also *be a slice* of the source tensor (``slice_keys``): when the plan retains every element
of it and those elements are one contiguous run of the source tensor (or zero1 shard). A
tensor-parallel split along the first axis of a column-parallel weight, the vocabulary or a stack
of heads keeps such a run: ``dp4 -> dp2-tp2`` keeps half of every replica; so does a zero1 shard
of a whole Adam moment: turning zero1 on keeps each rank's share of its moments.
The destination is then a view into the old storage; the rest of that storage must be given back
by the caller (``execute_switch(adopt_views=True)`` hands it to ``release``).

The engine asks an ``Adopter`` to take a source tensor over (``adopt(key, tensor) -> bool``): with
the default allocator the engine's own destination store takes it; for preallocated storage (a
megatron model built for the new layout) the caller rebinds its parameter or optimizer state to the
tensor, or declines (returns ``False``), and the engine copies as usual. A source tensor that is a
view into a larger buffer (or a slice) is adopted only where every tensor in that buffer is kept too,
or the caller gives back the rest of it (``adopt_views``): keeping it would otherwise keep the whole
old buffer alive.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from lightning_dynatrain.transition.local_state import RegionIndex, StoreKey, box_pieces, local_numel, stack_axes
from lightning_dynatrain.vps.mapping import Region
from lightning_dynatrain.vps.plan import Transfer

Adopter = Callable[[StoreKey, torch.Tensor], bool]


def _retained_whole(retains: Iterable[Transfer], src: RegionIndex, dst: RegionIndex
                    ) -> Iterator[tuple[StoreKey, Region, Region]]:
    """``(key, source region, destination region)`` of each destination local tensor the plan
    retains every element of."""
    src_locals, dst_locals = src.local_tensors(), dst.local_tensors()
    kept: Counter[StoreKey] = Counter()
    for t in retains:
        region = dst.find(t.tensor, t.kind, t.box)
        for key, sub in box_pieces(t.tensor, t.kind, region, t.box):
            kept[key] += sub.numel
    for key, n in kept.items():
        a, b = src_locals.get(key), dst_locals[key]
        if a is not None and n == local_numel(b):
            yield key, a, b


def kept_in_place_keys(retains: Iterable[Transfer], src: RegionIndex, dst: RegionIndex
                       ) -> tuple[frozenset[StoreKey], dict[StoreKey, tuple[int, int]]]:
    """Both kinds of destination local tensors the plan retains whole, in one pass over it:
    ``(adoptable_keys, slice_keys)``."""
    whole, runs = set(), {}
    for key, a, b in _retained_whole(retains, src, dst):
        n = stack_axes(b)  # the stack axes name the local tensor (the key), not a place in it
        if (a.origin[n:], a.view_shape, a.flat) == (b.origin[n:], b.view_shape, b.flat):
            whole.add(key)
            continue
        run = contiguous_run(a.origin[n:], a.view_shape, b.origin[n:], b.view_shape)
        if run is None:
            continue
        start, stop = run if b.flat is None else (run[0] + b.flat[0], run[0] + b.flat[1])
        lo, hi = a.flat if a.flat is not None else (0, math.prod(a.view_shape))
        if lo <= start and stop <= hi:
            runs[key] = (start - lo, stop - lo)
    return frozenset(whole), runs


def adoptable_keys(retains: Iterable[Transfer], src: RegionIndex, dst: RegionIndex) -> frozenset[StoreKey]:
    """Destination local tensors the plan retains whole, laid out exactly as in the source."""
    return kept_in_place_keys(retains, src, dst)[0]


def slice_keys(retains: Iterable[Transfer], src: RegionIndex, dst: RegionIndex) -> dict[StoreKey, tuple[int, int]]:
    """Destination local tensors (or zero1 shards) the plan retains whole that are one contiguous
    run of their source tensor (or shard), not laid out as it (``adoptable_keys``): key ->
    ``(start, stop)``, in elements of the source tensor as stored (a zero1 shard: from its start).

    E.g. a first-axis tensor-parallel shard of a replica, or a zero1 shard of Adam moments cut from
    a whole moment tensor (turning zero1 on).
    """
    return kept_in_place_keys(retains, src, dst)[1]


def contiguous_run(outer_origin: Sequence[int], outer_shape: Sequence[int], inner_origin: Sequence[int],
                   inner_shape: Sequence[int]) -> tuple[int, int] | None:
    """Where the box ``inner`` lies in the row-major order of the box ``outer`` (both given by origin
    and shape, same axes), as ``(start, stop)`` elements, when it is one contiguous run; else ``None``.

    A run: past the first axis where ``inner`` is longer than 1, it spans ``outer`` whole.
    """
    rel = [i - o for i, o in zip(inner_origin, outer_origin)]
    if any(r < 0 or r + s > full for r, s, full in zip(rel, inner_shape, outer_shape)):
        return None
    axes = [d for d, s in enumerate(inner_shape) if s > 1]
    if axes and any(inner_shape[d] != outer_shape[d] for d in range(axes[0] + 1, len(outer_shape))):
        return None
    start = 0
    for r, full in zip(rel, outer_shape):
        start = start * full + r
    return start, start + math.prod(inner_shape)


def owns_storage(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is all of its storage (not a view into a larger buffer)."""
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def take_over(_key: StoreKey, _tensor: torch.Tensor) -> bool:
    """The default adopter: the engine's own destination store takes the tensor."""
    return True


__all__ = ["Adopter", "adoptable_keys", "contiguous_run", "kept_in_place_keys", "owns_storage", "slice_keys", "take_over"]
