"""``Checkpointing``: ``DynaTrainStrategy``'s side of Lightning's save and restore calls, onto
layout-free checkpoint directories.

Checkpoints (``trainer.save_checkpoint``, ``ModelCheckpoint``, ``fit(ckpt_path=...)``) are
directories a run saved at one layout resumes from at any other layout and world size.
``DynaTrainStrategy`` owns one ``Checkpointing`` and hands it its checkpoint hooks
(``save_checkpoint``, ``load_checkpoint``, ``load_model_state_dict``, ...) and
``init_from_megatron``. What each hook restores, and why there: ``checkpoint/training_checkpoint.py``'s module
docstring (the work is in its plain functions; this object passes the run's current objects in).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dynatrain.checkpoint.writer import CheckpointWriter
from lightning_dynatrain.checkpoint import training_checkpoint as checkpoint

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dynatrain.runtime.training_run import TrainingRun
    from lightning_dynatrain.strategy.optimizer_handle import DynaTrainOptimizer
    from lightning_dynatrain.vps.spec import ModelSpec


class Checkpointing:
    """The checkpoint hooks of ``DynaTrainStrategy`` (see the module docstring).

    Args:
        run: the run whose state it saves and restores (its recipe, layout, model shard and state).
        writer: writes the checkpoint directories (in the background with ``async_save``).
        trainer: the running trainer, ``None`` outside a fit (the strategy's ``_running_trainer``).
        handle: Lightning's optimizer handle (its schedule group is saved and restored).
        joining: whether this process joins an elastic fit (its optimizer state comes from the
            members, not from Lightning).
    """

    def __init__(self, run: "TrainingRun", *, writer: CheckpointWriter, trainer: "Callable[[], pl.Trainer | None]",
                 handle: "Callable[[], DynaTrainOptimizer]", joining: Callable[[], bool]) -> None:
        self._run = run
        self.writer = writer
        self._trainer = trainer
        self._handle = handle
        self._joining = joining

    def latest_path(self) -> str | None:
        """The run's latest checkpoint: a ``ModelCheckpoint``'s last (else best) save, else the one
        this fit resumed from; ``None`` when there is none (what a failed switch names to resume from)."""
        trainer = self._trainer()
        if trainer is None:
            return None
        for callback in trainer.checkpoint_callbacks:
            path = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
            if path:
                return str(path)
        return str(trainer.ckpt_path) if trainer.ckpt_path else None

    def spec(self) -> "ModelSpec":
        """The model's sharded description, the keys and shapes every checkpoint is written under."""
        return self._run.recipe.model.spec()

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's layout-free scalars: Adam's step, each kind of param group's settings and
        the schedule group's (moments and main params are saved under their logical keys)."""
        return {**checkpoint.optimizer_scalars(self._run.state), "schedule": self._handle().schedule_state()}

    @property
    def lightning_restores_optimizer(self) -> bool:
        """A joiner's optimizer state came through the engine; otherwise Lightning restores it."""
        return not self._joining()

    def save(self, state_dict: dict[str, Any], filepath: str | Path, storage_options: Any | None = None, *,
             rank: int, world_size: int) -> None:
        """Write a layout-free checkpoint directory at ``filepath`` (collective; in the background
        with ``async_save``)."""
        if storage_options is not None:
            raise TypeError("DynaTrainStrategy.save_checkpoint does not take storage_options")
        run = self._run
        checkpoint.save(state_dict, filepath, writer=self.writer, model=run.model_shard, state=run.state_or_none,
                        spec=self.spec(), layout=run.layout, rank=rank, world_size=world_size,
                        config=run.recipe.model.config_record())

    def remove(self, filepath: str | Path, *, is_global_zero: bool) -> None:
        self.writer.wait_for(filepath)
        if is_global_zero:
            from lightning_dynatrain.checkpoint.writer import remove_path

            remove_path(filepath)

    def read(self, checkpoint_path: str | Path, weights_only: bool | None = None, *, rank: int,
             world_size: int) -> dict[str, Any]:
        """Lightning's part of checkpoint ``checkpoint_path``, once it is checked to hold this run's model."""
        from lightning_dynatrain.megatron.state_bridge import precision_of

        run = self._run
        self.writer.wait_for(checkpoint_path)
        return checkpoint.read(checkpoint_path, spec=self.spec(), precision=precision_of(run.model_shard),
                               layout=run.layout, rank=rank, world_size=world_size,
                               weights_only=weights_only, config=run.recipe.model.config_record())

    def load_params(self, state_dict: Mapping[str, Any], *, rank: int) -> bool:
        """The parameters, into the model before megatron DDP and the optimizer are built from them;
        ``False`` for a per-rank checkpoint of earlier versions (Lightning's own loading reads it)."""
        source = checkpoint.source_of(state_dict)
        if source is None or source.kind == "per_rank":
            return False
        checkpoint.load_params(state_dict, self._run.model_shard, self.spec(), self._run.layout, rank)
        return True

    def load_optimizer(self, state_dict: Mapping[str, Any], *, rank: int) -> bool:
        """Adam's step, the group settings, main params and moments, into the optimizer ``setup``
        built; ``False`` for a per-rank checkpoint (as ``load_params``)."""
        source = checkpoint.source_of(state_dict)
        if source is None or source.kind == "per_rank":
            return False
        checkpoint.load_optimizer(state_dict, self._run.state, self.spec(), rank)
        scalars = (state_dict.get("optimizer_states") or [{}])[0]
        if "schedule" in scalars:  # the rate the next step uses, as the schedule left it
            self._handle().load_schedule(scalars["schedule"])
        return True

    def start_from_megatron(self, trainer: "pl.Trainer", source: Path | None) -> None:
        """``init_from_megatron`` (``source``): after ``setup_optimizers`` (the optimizer's tensors exist then)."""
        if source is None or trainer.ckpt_path is not None:
            return
        from lightning_dynatrain.checkpoint.megatron_import import load_megatron_checkpoint

        run = self._run
        step = load_megatron_checkpoint(source, model=run.model_shard, state=run.state_or_none)
        rank_zero_info(f"[dynatrain] started from megatron checkpoint {source} at {run.layout}"
                       + (f" (Adam step {step})" if step is not None else " (weights only)"))

    def close(self) -> None:
        """Wait for a background save (before its groups go)."""
        self.writer.close()


__all__ = ["Checkpointing"]
