"""Reading a layout-free checkpoint directory: Lightning's part on every rank, the state into live tensors.

A checkpoint directory is one DCP checkpoint holding

- ``TRAINER_KEY``: Lightning's checkpoint dict without the tensors (loops, callbacks' states, the
  optimizer's scalars, hyper-parameters; ``CheckpointInfo`` under ``"dynatrain"``), pickled once
  by rank 0 (``encode_trainer_state``);
- ``<tensor>::<kind>``: every piece of state under its logical key and global offsets
  (``checkpoint.logical``).

``read_trainer_state`` reads the first on each rank by itself (no collective); ``load_logical``
fills a layout's live tensors from the second (collective), for the state kinds asked, so the
parameters can be filled as soon as the model exists and the optimizer's state once it exists.

Example (every rank)::

    checkpoint = read_trainer_state(path)
    info = CheckpointInfo.from_dict(checkpoint["dynatrain"], path=path)
    load_logical(param_store(model, spec, layout, rank), spec, layout, rank, path, kinds=[StateKind.PARAM])
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_dynatrain.checkpoint.identity import CheckpointError
from lightning_dynatrain.checkpoint.logical import logical_load_state_dict, saved_shapes
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec, Precision, StateKind

#: The DCP key of Lightning's part (one pickled blob, written by rank 0).
TRAINER_KEY = "dynatrain.trainer"
#: The key of ``CheckpointInfo`` inside Lightning's dict.
INFO_KEY = "dynatrain"


def is_layout_free(path: str | Path) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (it has DCP's ``.metadata``)."""
    return (Path(path) / ".metadata").is_file()


def encode_trainer_state(checkpoint: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def read_trainer_state(path: str | Path, *, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dict of checkpoint ``path`` (each rank reads it by itself).

    Raises:
        CheckpointError: ``path`` is not a layout-free checkpoint directory.
    """
    if not is_layout_free(path):
        raise CheckpointError(f"{path} is not a DCP checkpoint directory (no .metadata)",
                              hint="pass a directory written by trainer.save_checkpoint under DynaTrainStrategy")
    reader = dcp.FileSystemReader(str(path))
    if TRAINER_KEY not in reader.read_metadata().state_dict_metadata:
        megatron = (Path(path) / "metadata.json").is_file()
        raise CheckpointError(
            f"{path} is a DCP checkpoint but not one of DynaTrainStrategy"
            + (" (megatron dist_checkpointing wrote it)" if megatron else ""),
            hint="start from a megatron checkpoint with DynaTrainStrategy(init_from_megatron=PATH)" if megatron
            else "pass a directory written by trainer.save_checkpoint under DynaTrainStrategy")
    state: dict[str, Any] = {TRAINER_KEY: b""}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return torch.load(io.BytesIO(state[TRAINER_KEY]), map_location="cpu", weights_only=bool(weights_only))


def load_logical(store: dict, spec: ModelSpec, layout: ParallelConfig, rank: int, path: str | Path, *,
                 precision: Precision = Precision.FP32, kinds: Iterable[StateKind] | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
    """Fill ``store`` (this rank's live local tensors at ``layout``) with the checkpoint's state of
    ``kinds`` (all kinds the layout has when ``None``); collective over ``group`` (the world)."""
    state = logical_load_state_dict(store, spec, layout, rank, precision=precision, kinds=kinds,
                                    saved=saved_shapes(str(path)))
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), process_group=group)


__all__ = ["INFO_KEY", "TRAINER_KEY", "encode_trainer_state", "is_layout_free", "load_logical", "read_trainer_state"]
