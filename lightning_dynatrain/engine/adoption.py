"""Keeping retained state in place: which destination local tensors can simply *be* the source ones.

A destination local tensor can take over its source tensor's storage, with no copy and no new
allocation, when

- the plan retains every element of it (nothing is received into it, nothing filled), and
- the same key has the same local layout in both layouts (origin, local shape, and for a zero1
  shard the same flat range), so every element sits at the same offset before and after.

That is common: a pipeline change keeps whole layers on the ranks that held them, turning zero1 on
keeps every parameter, and a data-parallel change keeps every rank's tensor-parallel shard.

The engine asks an ``Adopter`` to take a source tensor over (``adopt(key, tensor) -> bool``): with
the default allocator the engine's own destination store takes it; for preallocated storage (a
megatron model built for the new layout) the caller rebinds its parameter or optimizer state to the
tensor, or declines (returns ``False``), and the engine copies as usual. A source tensor that is a
view into a larger buffer is never adopted: keeping it would keep the whole old buffer alive.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import torch

from lightning_dynatrain.engine.store import RegionIndex, StoreKey, box_pieces, local_numel, stack_axes
from lightning_dynatrain.vps.plan import Transfer

Adopter = Callable[[StoreKey, torch.Tensor], bool]


def adoptable_keys(retains: Iterable[Transfer], src: RegionIndex, dst: RegionIndex) -> frozenset[StoreKey]:
    """Destination local tensors the plan retains whole, laid out exactly as in the source."""
    src_locals, dst_locals = src.local_tensors(), dst.local_tensors()
    kept: Counter[StoreKey] = Counter()
    for t in retains:
        region = dst.find(t.tensor, t.kind, t.box)
        for key, sub in box_pieces(t.tensor, t.kind, region, t.box):
            kept[key] += sub.numel
    out = set()
    for key, n in kept.items():
        a, b = src_locals.get(key), dst_locals[key]
        if a is None or n != local_numel(b):
            continue
        n = stack_axes(b)  # the stack axes name the local tensor (the key), not a place in it
        if (a.origin[n:], a.view_shape, a.flat) == (b.origin[n:], b.view_shape, b.flat):
            out.add(key)
    return frozenset(out)


def owns_storage(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is all of its storage (not a view into a larger buffer)."""
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def take_over(_key: StoreKey, _tensor: torch.Tensor) -> bool:
    """The default adopter: the engine's own destination store takes the tensor."""
    return True


__all__ = ["Adopter", "adoptable_keys", "owns_storage", "take_over"]
