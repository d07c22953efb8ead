"""Per-rank Lightning checkpoints for ``DynaTrainStrategy`` (resume at the same layout).

A checkpoint path is a directory with one file per rank, ``rank00000.pt``, ..., each holding
Lightning's whole checkpoint dict with this rank's model shard (``state_dict``), this rank's
optimizer state (``optimizer_states``) and a ``"dynatrain"`` entry: the layout, the world size and
the rank. Loading checks that entry: model shards are stage-local and optimizer shards are flat
buffer ranges, so a checkpoint is only meaningful at the layout that wrote it. To continue at
another layout, resume at the saved one and ``reconfigure`` (an in-memory switch).

Example layout on disk, 4 ranks::

    checkpoints/epoch=0-step=200.ckpt/rank00000.pt ... rank00003.pt
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig


def rank_file(path: str | Path, rank: int) -> Path:
    """The file of ``rank`` inside checkpoint directory ``path``."""
    return Path(path) / f"rank{rank:05d}.pt"


def save_rank_checkpoint(checkpoint: dict[str, Any], path: str | Path, *, rank: int, layout: ParallelConfig,
                         world_size: int) -> Path:
    """Write this rank's part; every rank calls it (the directory is created by whoever comes first)."""
    path = Path(path)
    if path.is_file():
        path.unlink()  # a single-file checkpoint of the same name from another strategy
    path.mkdir(parents=True, exist_ok=True)
    target = rank_file(path, rank)
    torch.save({**checkpoint, "dynatrain": {"layout": str(layout), "world_size": world_size, "rank": rank}}, target)
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
            hint=f"resume with DynaTrainStrategy(layout={meta.get('layout')!r}) on the same number of processes, "
            "then switch in memory (reconfigure / ScheduledReconfig)",
        )
    return checkpoint


__all__ = ["load_rank_checkpoint", "rank_file", "save_rank_checkpoint"]
