"""``accelerator.save_state`` / ``load_state`` for a ``DynaTrainEngine``: the engine's layout-free checkpoint.

Accelerate writes each model's ``state_dict()`` and each optimizer's ``state_dict()`` from rank 0
only (wrong for tensor- and pipeline-parallel shards, ``loop/checkpoint.py``). So the engine
registers Accelerate's save and load pre-hooks, which take its model out of Accelerate's lists and
write (read) the engine's state instead::

    checkpoint/                       # accelerator.save_state("checkpoint")
      dynatrain/                      # every piece of state under its logical key (DCP; loop.checkpoint)
      optimizer.bin                   # LoopOptimizer.state_dict(): where it was written
      custom_checkpoint_0.pkl         # DynaTrainEngine.state_dict(): step, schedule progress, switches
      random_states_<rank>.pkl        # Accelerate's own

``load_state`` reads the engine's state first, into the layout the engine runs at (any layout, any
number of processes), then Accelerate loads the custom checkpoints: the engine's progress.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_dynatrain.loop.checkpoint import CheckpointError, load_engine_state, save_engine_state

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.hooks import RemovableHandle

    from lightning_dynatrain.loop.engine import DynaTrainEngine


def register_checkpoint_hooks(accelerator: "Accelerator", engine: "DynaTrainEngine") -> list["RemovableHandle"]:
    """Register the save and load pre-hooks of ``engine`` on ``accelerator``; their handles."""

    def save(models: list, weights: list, output_dir: str) -> None:
        index = _position(models, engine.model)
        if index is not None and index < len(weights):
            del weights[index]  # Accelerate would write this (empty) state dict as model.safetensors
        save_engine_state(engine, output_dir)

    def load(models: list, input_dir: str) -> None:
        index = _position(models, engine.model)
        if index is not None:
            del models[index]  # a local list of load_state: Accelerate then loads no weights for it
        load_engine_state(engine, input_dir)

    return [accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)]


def _position(items: list, target: Any) -> int | None:
    return next((i for i, item in enumerate(items) if item is target), None)


__all__ = ["CheckpointError", "register_checkpoint_hooks"]
