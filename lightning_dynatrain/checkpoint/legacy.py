"""Per-rank checkpoints of earlier lightning-dynatrain versions: read at the layout that wrote them.

Before layout-free checkpoints (``checkpoint.reader``), a checkpoint path was a directory with one
file per rank, ``rank00000.pt``, ..., each holding Lightning's whole checkpoint dict with this
rank's model shard (``state_dict``), this rank's optimizer state (``optimizer_states``: the inner
torch optimizers' state dicts) and a ``"dynatrain"`` entry: the layout, the world size and the
rank. Model shards are stage-local and optimizer shards are flat buffer ranges, so such a
checkpoint is only meaningful at the layout that wrote it: ``DynaTrainStrategy`` still resumes
from one at that layout and world size (and refuses any other with a ``LayoutError`` naming it),
and every checkpoint the resumed run writes is layout-free. The strategy no longer writes this
format; ``save_rank_checkpoint`` stays as its definition (tests write fixtures with it).

A tensor is written with its whole storage (``torch.save``). After a switch, a kept slice of an old
tensor or a tensor carved from an old storage (``devices.host.recycler``) may live in a storage much
larger than the tensors the checkpoint names in it; such tensors are written as compact copies
(``compact_storages``), so a file holds the state, not the old layouts' leftovers.

Example layout on disk, 4 ranks::

    checkpoints/epoch=0-step=200.ckpt/rank00000.pt ... rank00003.pt
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig


def is_per_rank(path: str | Path) -> bool:
    """Whether ``path`` is a per-rank checkpoint directory (it has rank 0's file)."""
    return rank_file(path, 0).is_file()


def rank_file(path: str | Path, rank: int) -> Path:
    """The file of ``rank`` inside checkpoint directory ``path``."""
    return Path(path) / f"rank{rank:05d}.pt"


def compact_storages(obj: Any, *, slack: float = 0.0625) -> Any:
    """``obj`` (nested dicts, lists, tuples) with each tensor whose storage is more than ``slack``
    larger than the bytes the tensors of ``obj`` view in it replaced by a compact copy; every other
    object (a zero1 buffer's param views, which cover their storage) is passed through as it is."""
    tensors: dict[int, torch.Tensor] = {}
    _collect(obj, tensors)
    viewed: dict[int, list[tuple[int, int]]] = {}
    for t in tensors.values():
        start = t.data_ptr()
        viewed.setdefault(t.untyped_storage().data_ptr(), []).append((start, start + t.nbytes))
    covered = {}
    for address, spans in viewed.items():
        total, end = 0, -1
        for lo, hi in sorted(spans):  # the union of the viewed byte ranges
            total += max(0, hi - max(lo, end))
            end = max(end, hi)
        covered[address] = total
    loose = {i for i, t in tensors.items()
             if t.untyped_storage().nbytes() > covered[t.untyped_storage().data_ptr()] * (1 + slack)}
    if not loose:
        return obj
    copies = {i: tensors[i].clone() for i in loose}  # one copy per tensor: a tensor named twice stays one
    return _replace(obj, copies)


def _collect(obj: Any, out: dict[int, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta" and obj.untyped_storage().nbytes():
            out[id(obj)] = obj
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect(value, out)


def _replace(obj: Any, copies: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return copies.get(id(obj), obj)
    if isinstance(obj, dict):  # a shallow copy keeps the type and attributes (a state dict's ``_metadata``)
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = _replace(value, copies)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_replace(v, copies) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(v, copies) for v in obj)
    return obj


def save_rank_checkpoint(checkpoint: dict[str, Any], path: str | Path, *, rank: int, layout: ParallelConfig,
                         world_size: int) -> Path:
    """Write this rank's part; every rank calls it (the directory is created by whoever comes first)."""
    path = Path(path)
    if path.is_file():
        path.unlink()  # a single-file checkpoint of the same name from another strategy
    path.mkdir(parents=True, exist_ok=True)
    target = rank_file(path, rank)
    meta = {"layout": str(layout), "world_size": world_size, "rank": rank}
    torch.save({**compact_storages(checkpoint), "dynatrain": meta}, target)
    return target


def load_rank_checkpoint(path: str | Path, *, rank: int, layout: ParallelConfig, world_size: int,
                         weights_only: bool | None = None) -> dict[str, Any]:
    """Read this rank's part and check it was written at ``layout`` on ``world_size`` ranks.

    Raises:
        FileNotFoundError: no file for this rank (not a DynaTrainStrategy checkpoint?).
        LayoutError: the checkpoint was written at another layout or world size.
    """
    target = rank_file(path, rank)
    if not target.is_file():
        raise FileNotFoundError(
            f"{target} does not exist. HINT: DynaTrainStrategy checkpoints are directories with one "
            "rankNNNNN.pt per rank, written by the same strategy"
        )
    checkpoint = torch.load(target, map_location="cpu", weights_only=bool(weights_only))
    meta = checkpoint.pop("dynatrain", {})
    if meta.get("layout") != str(layout) or meta.get("world_size") != world_size:
        raise LayoutError(
            f"checkpoint {path} was written at layout {meta.get('layout')} on {meta.get('world_size')} ranks, "
            f"this run is at {layout} on {world_size}",
            hint=f"this per-rank checkpoint of an earlier version only loads where it was written: resume with "
            f"DynaTrainStrategy(layout={meta.get('layout')!r}) on the same number of processes (then switch in memory, "
            "or save: checkpoints written now are layout-free and load at any layout)",
        )
    return checkpoint


__all__ = ["compact_storages", "is_per_rank", "load_rank_checkpoint", "rank_file", "save_rank_checkpoint"]
