"""``DynaTrainStrategy``'s checkpoint hooks: Lightning's save and restore calls, onto layout-free
checkpoint directories.

What each hook restores, and why there: ``strategy/checkpoint.py``'s module docstring (the work
is in its plain functions; these hooks only pass the strategy's current objects in).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dynatrain.strategy import checkpoint as checkpointing

if TYPE_CHECKING:
    import lightning.pytorch as pl


class CheckpointHooks:
    """Lightning's checkpoint hooks for ``DynaTrainStrategy`` (a mixin before its Lightning base).

    Reads the strategy's ``recipe``, ``layout``, ranks, ``megatron`` state, model shard
    (``_gpt_model``), checkpoint writer (``_writer``) and elastic driver (``_elastic``).
    """

    def _spec(self):
        return self.recipe.model.spec()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the weights are saved under their logical keys with the rest of the state (``save_checkpoint``)."""
        return {}

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's layout-free scalars: Adam's step, each kind of param group's settings and
        the schedule group's (moments and main params are saved under their logical keys)."""
        return {**checkpointing.optimizer_scalars(self.megatron), "schedule": self.optimizer_handle.schedule_state()}

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """A joiner's optimizer state came through the engine; otherwise Lightning restores it."""
        return not (self._elastic is not None and self._elastic.joining)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        """Write a layout-free checkpoint directory at ``filepath`` (collective; in the background
        with ``async_save``)."""
        if storage_options is not None:
            raise TypeError("DynaTrainStrategy.save_checkpoint does not take storage_options")
        checkpointing.save(checkpoint, filepath, writer=self._writer, model=self._gpt_model, state=self._megatron,
                           spec=self._spec(), layout=self.layout, rank=self.global_rank, world_size=self.world_size,
                           config=self.recipe.model.config_record())

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        self._writer.wait_for(filepath)
        if self.is_global_zero:
            from lightning_dynatrain.checkpoint.writer import remove_path

            remove_path(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's part of checkpoint ``checkpoint_path``, once it is checked to hold this run's model."""
        from lightning_dynatrain.megatron.state_bridge import precision_of

        self._writer.wait_for(checkpoint_path)
        return checkpointing.read(checkpoint_path, spec=self._spec(), precision=precision_of(self._gpt_model),
                                  layout=self.layout, rank=self.global_rank, world_size=self.world_size,
                                  weights_only=weights_only, config=self.recipe.model.config_record())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The parameters, into the model before megatron DDP and the optimizer are built from them."""
        source = checkpointing.source_of(checkpoint)
        if source is None or source.kind == "per_rank":
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        checkpointing.load_params(checkpoint, self._gpt_model, self._spec(), self.layout, self.global_rank)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Adam's step, the group settings, main params and moments, into the optimizer ``setup`` built."""
        source = checkpointing.source_of(checkpoint)
        if source is None or source.kind == "per_rank":
            super().load_optimizer_state_dict(checkpoint)
            return
        checkpointing.load_optimizer(checkpoint, self.megatron, self._spec(), self.global_rank)
        scalars = (checkpoint.get("optimizer_states") or [{}])[0]
        if "schedule" in scalars:  # the rate the next step uses, as the schedule left it
            self.optimizer_handle.load_schedule(scalars["schedule"])

    def _start_from_megatron(self, trainer: "pl.Trainer") -> None:
        """``init_from_megatron``: after ``setup_optimizers`` (the optimizer's tensors exist then)."""
        if self.init_from_megatron is None or trainer.ckpt_path is not None:
            return
        from lightning_dynatrain.checkpoint.megatron_import import load_megatron_checkpoint

        step = load_megatron_checkpoint(self.init_from_megatron, model=self._gpt_model, state=self._megatron)
        rank_zero_info(f"[dynatrain] started from megatron checkpoint {self.init_from_megatron} at {self.layout}"
                       + (f" (Adam step {step})" if step is not None else " (weights only)"))


__all__ = ["CheckpointHooks"]
