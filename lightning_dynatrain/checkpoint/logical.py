"""The training state as PyTorch DCP sees it: one ``ShardedTensor`` per logical tensor and state kind.

Plain DCP over ``module.state_dict()`` reshards pipeline stages wrong (keys carry stage-local layer
indices). Here every checkpoint key is a logical tensor and state kind (``<tensor>::<kind>``, e.g.
``decoder.layers.mlp.linear_fc1.weight::exp_avg``), one ``ShardedTensor`` of the logical shape
(global layer and expert axes, vocabulary at the layout's padded size) whose shards are the rank's
pieces (``transition.pieces``): its TP/PP/EP boxes, one per local tensor, and its zero1 shards as boxes
too. Saving, replicas are written once (only a piece's primary holder lists it as a local shard).
Loading at another layout lists *every* piece the rank holds (replicas too): DCP intersects them
with the saved chunks and copies straight into the live storage (the shards are views of it).

The vocabulary axis is the one extent that depends on the layout (megatron pads it to a multiple
of ``make_vocab_size_divisible_by * tp``). A checkpoint written at a larger padding has rows this
layout does not keep (read into a small scratch shard and dropped); one written at a smaller
padding lacks rows this layout has: they are zeroed, as a hot switch fills them (``RankPlan.fills``).

Example, two ranks of ``dp1-tp2``, ``embedding.word_embeddings.weight`` ``[256, 32]``: rank 0's
shard is ``[0:128, 0:32]``, rank 1's ``[128:256, 0:32]``; loaded at ``dp2-tp1`` both ranks list
``[0:256, 0:32]`` and DCP reads both saved chunks into each.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_dynatrain.checkpoint.identity import CheckpointMismatchError
from lightning_dynatrain.compat.torch_internals import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    sharded_tensor_from_shards,
)
from lightning_dynatrain.transition.pieces import LayoutPieces, Piece, TensorKind, layout_pieces
from lightning_dynatrain.vps.box import Box
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import VOCAB, ModelSpec, Precision, StateKind

SEPARATOR = "::"


def fqn(tk: TensorKind) -> str:
    """The checkpoint key of a logical tensor's state kind: ``<tensor>::<kind>``."""
    return f"{tk[0]}{SEPARATOR}{tk[1].value}"


def parse_fqn(key: str) -> TensorKind | None:
    """``fqn``'s inverse; ``None`` for a key that is not a logical tensor's (scalars, metadata)."""
    tensor, sep, kind = key.rpartition(SEPARATOR)
    if not sep:
        return None
    try:
        return tensor, StateKind(kind)
    except ValueError:
        return None


def saved_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """``key -> global shape`` of every tensor in the DCP checkpoint at ``path`` (reads ``.metadata``)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {k: tuple(md.size) for k, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def _placement(rank: int, device: torch.device) -> str:
    return f"rank:{rank}/{device}"


def _sharded(shape: tuple[int, ...], boxes: Iterable[tuple[Box, int]], local: list[tuple[Box, torch.Tensor]],
             rank: int, dtype: torch.dtype, device: torch.device) -> ShardedTensor:
    """A ShardedTensor of ``shape`` whose global shards are ``boxes`` (each on its rank) and whose
    local shards are ``local`` (box, view of the live tensor)."""
    shards_md = [ShardMetadata(list(box.lo), list(box.shape), _placement(owner, device)) for box, owner in boxes]
    shards = []
    for box, view in local:
        if not view.is_contiguous():
            raise AssertionError(f"piece {box}: a non-contiguous view cannot be a ShardedTensor shard")
        shards.append(Shard(view, ShardMetadata(list(box.lo), list(box.shape), _placement(rank, device))))
    metadata = ShardedTensorMetadata(shards_md, torch.Size(shape), TensorProperties(dtype=dtype))
    return sharded_tensor_from_shards(shards, metadata)


def _wanted(pieces: LayoutPieces, kinds: Iterable[StateKind] | None) -> list[TensorKind]:
    keep = None if kinds is None else set(kinds)
    return [tk for tk in pieces.holders if keep is None or tk[1] in keep]


def _store_dtype(local: list[Piece], store: dict, spec: ModelSpec, tk: TensorKind, precision: Precision) -> torch.dtype:
    if local:
        return store[local[0].key].dtype
    return getattr(torch, precision.dtype_name(tk[1], spec.tensor(tk[0])))


def _device(store: dict) -> torch.device:
    return next(iter(store.values())).device if store else torch.device("cpu")


def logical_state_dict(store: dict, spec: ModelSpec, layout: ParallelConfig, rank: int, *,
                       precision: Precision = Precision.FP32, kinds: Iterable[StateKind] | None = None,
                       copy_to_cpu: bool = False) -> dict[str, ShardedTensor]:
    """For saving: ``<tensor>::<kind>`` -> ShardedTensor over the pieces this rank is the primary
    holder of, every (tensor, kind) of the layout (of ``kinds``) on every rank.

    The shards are views of ``store``, or with ``copy_to_cpu`` private CPU copies of them (for a
    background save: training goes on changing the live tensors). A ShardedTensor needs at least
    one global shard, so each key appears on every rank, possibly with no local shard.
    """
    pieces = layout_pieces(spec, layout, precision)
    mine = pieces.mine(rank, primary_only=True)
    device = torch.device("cpu") if copy_to_cpu else _device(store)
    out = {}
    for tk in _wanted(pieces, kinds):
        local = mine.get(tk, [])
        boxes = [(box, holders[0]) for box, holders in pieces.holders[tk].items()]
        views = [(p.box, p.view(store)) for p in local]
        if copy_to_cpu:
            views = [(box, view.to("cpu", copy=True)) for box, view in views]
        out[fqn(tk)] = _sharded(pieces.stored_shape[tk[0]], boxes, views, rank,
                                _store_dtype(local, store, spec, tk, precision), device)
    return out


@dataclass(frozen=True, slots=True)
class _Clip:
    """How one (tensor, kind) of this layout meets the checkpoint's extent along the vocabulary axis."""

    axis: int | None
    saved: int  # rows the checkpoint has (== this layout's when the extents agree)
    here: int  # rows this layout stores


def _clip_of(spec: ModelSpec, tk: TensorKind, here: tuple[int, ...], saved: tuple[int, ...] | None) -> _Clip:
    axis = spec.tensor(tk[0]).axis_of(VOCAB)
    if saved is None or saved == here:
        return _Clip(None, 0, 0)
    other = [a for a, (x, y) in enumerate(zip(here, saved)) if x != y]
    if axis is None or other != [axis] or len(here) != len(saved):
        raise CheckpointMismatchError(
            f"{fqn(tk)} has shape {saved} in the checkpoint and {here} in this model",
            hint="load a checkpoint of the same model (GPTShape) as the one being trained")
    return _Clip(axis, saved[axis], here[axis])


def _cut(box: Box, axis: int, lo: int, hi: int) -> Box | None:
    return box.intersect(Box(tuple(lo if a == axis else 0 for a in range(box.ndim)),
                             tuple(hi if a == axis else h for a, h in enumerate(box.hi))))


def logical_load_state_dict(store: dict, spec: ModelSpec, layout: ParallelConfig, rank: int, *,
                            precision: Precision = Precision.FP32, kinds: Iterable[StateKind] | None = None,
                            saved: dict[str, tuple[int, ...]] | None = None) -> dict[str, ShardedTensor]:
    """For loading: ``<tensor>::<kind>`` -> ShardedTensor over *every* piece this rank holds.

    ``saved`` (``saved_shapes``) are the checkpoint's global shapes; where its vocabulary extent
    differs from this layout's, the ShardedTensor takes the checkpoint's shape: rows beyond it
    are zeroed here (this layout's extra padding), rows only the checkpoint has are covered by a
    scratch shard on rank 0 (read, then dropped).
    """
    pieces = layout_pieces(spec, layout, precision)
    mine = pieces.mine(rank, primary_only=False)
    device = _device(store)
    out = {}
    for tk in _wanted(pieces, kinds):
        here = pieces.stored_shape[tk[0]]
        clip = _clip_of(spec, tk, here, None if saved is None else saved.get(fqn(tk)))
        local = mine.get(tk, [])
        dtype = _store_dtype(local, store, spec, tk, precision)
        mine_boxes = {p.box for p in local}
        boxes = [(box, rank if box in mine_boxes else holders[0]) for box, holders in pieces.holders[tk].items()]
        views = [(p.box, p.view(store)) for p in local]
        shape = here
        if clip.axis is not None:
            shape = tuple(clip.saved if a == clip.axis else n for a, n in enumerate(here))
            boxes = [(cut, owner) for box, owner in boxes if (cut := _cut(box, clip.axis, 0, clip.saved))]
            views = _clip_views(views, clip)
            if clip.saved > clip.here:  # rows only the checkpoint has: one scratch shard on rank 0
                extra = Box(tuple(clip.here if a == clip.axis else 0 for a in range(len(shape))), shape)
                boxes.append((extra, 0))
                if rank == 0:
                    views.append((extra, torch.empty(extra.shape, dtype=dtype, device=device)))
        out[fqn(tk)] = _sharded(shape, boxes, views, rank, dtype, device)
    return out


def _clip_views(views: list[tuple[Box, torch.Tensor]], clip: _Clip) -> list[tuple[Box, torch.Tensor]]:
    """Views cut to the checkpoint's rows; the rows beyond them zeroed (this layout's own padding)."""
    out = []
    for box, view in views:
        lo, hi = box.lo[clip.axis], box.hi[clip.axis]
        keep = max(0, min(hi, clip.saved) - lo)
        if keep < hi - lo:
            view.narrow(clip.axis, keep, hi - lo - keep).zero_()
        if keep:
            out.append((_cut(box, clip.axis, lo, lo + keep), view.narrow(clip.axis, 0, keep)))
    return out


__all__ = ["SEPARATOR", "fqn", "logical_load_state_dict", "logical_state_dict", "parse_fqn", "saved_shapes"]
