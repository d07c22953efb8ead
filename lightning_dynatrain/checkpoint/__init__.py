"""Layout-free checkpoints: every piece of training state under its logical key and global offsets.

- ``logical``: the state as DCP ``ShardedTensor``s keyed ``<tensor>::<kind>`` (save and load at any layout);
- ``identity``: what a checkpoint says it holds (model digest, precision, kinds), and the typed errors;
- ``writer``: writing a checkpoint directory, synchronously or in the background (``dcp.async_save``);
- ``reader``: Lightning's part of a checkpoint, and loading state into a layout's live tensors;
- ``megatron_import``: starting from a checkpoint megatron-core's ``dist_checkpointing`` wrote;
- ``legacy``: the per-rank checkpoints of earlier versions (read at the layout that wrote them).

``checkpoint/training_checkpoint.py`` puts them behind ``DynaTrainStrategy``'s checkpoint hooks. Importing
this package does not import megatron-core (``megatron_import`` does).
"""

from lightning_dynatrain.checkpoint.identity import (
    FORMAT,
    CheckpointError,
    CheckpointInfo,
    CheckpointMismatchError,
    spec_digest,
)
from lightning_dynatrain.checkpoint.logical import fqn, logical_load_state_dict, logical_state_dict, saved_shapes
from lightning_dynatrain.checkpoint.reader import is_layout_free, load_logical, read_trainer_state
from lightning_dynatrain.checkpoint.writer import CheckpointWriter

__all__ = [
    "FORMAT",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointWriter",
    "fqn",
    "is_layout_free",
    "load_logical",
    "logical_load_state_dict",
    "logical_state_dict",
    "read_trainer_state",
    "saved_shapes",
    "spec_digest",
]
