"""``Stepping``: ``DynaTrainStrategy``'s training-step entry points and the reduce of what they log.

``DynaTrainStrategy`` owns one and hands it ``train_step`` and ``eval_step`` (called from a
LightningModule's ``training_step`` / ``validation_step``), ``num_microbatches`` and Lightning's
``reduce`` (over the current layout's data-parallel group). When a switch requested during a step
runs: ``strategy/switch_control.py``; the step itself is ``megatron_step``'s.

The dataloader serves the same GLOBAL batch on every rank (``GlobalBatchSampler``); each step
slices this rank's data-parallel share, so a switch needs no dataloader rebuild, and the loss it
returns is already the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.types import ReduceOp

from lightning_dynatrain.compat.lightning_internals import step_start_collectives, sync_ddp_if_available

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy


class Stepping:
    """The training-step entry points of ``DynaTrainStrategy`` (see the module docstring).

    Args:
        strategy: the strategy it steps for; read: ``megatron`` (``megatron_or_none`` where a
            ``validate`` run has none), ``model_shard``, ``groups``, ``recipe``, ``layout``,
            ``optimizer_handle``, ``elastic`` and the trainer of its ``lightning_module``.
        local_collectives: whether the collectives Lightning asks for are local no-ops now (the
            strategy's ``_collectives_are_local``).
    """

    def __init__(self, strategy: "DynaTrainStrategy", *, local_collectives: Callable[[], bool]) -> None:
        self._strategy = strategy
        self._local_collectives = local_collectives

    def train_step(self, optimizer: "LightningOptimizer", batch: Mapping[str, torch.Tensor], *,
                   lr: float | None = None, weight_decay: float | None = None) -> float:
        """One optimizer step over the global ``batch``, through Lightning's ``optimizer`` (so that
        Lightning counts it); the global mean loss. ``lr`` / ``weight_decay``: this step's values;
        ``None``: what the optimizer's schedule group holds."""
        scheduled_lr, scheduled_wd = self._strategy.optimizer_handle.scheduled
        closure = partial(self.optimizer_step, batch, lr=scheduled_lr if lr is None else lr,
                          weight_decay=scheduled_wd if weight_decay is None else weight_decay)
        return optimizer.step(closure=closure)

    def optimizer_step(self, batch: Mapping[str, torch.Tensor], *, lr: float, weight_decay: float) -> float:
        """The megatron step; under ``OnNodeChange``, a member lost in it is recovered from here
        (``strategy/recovery.py``) and the step runs again at the survivors' layout on the same
        global batch, or counts as done where its result survived."""
        from lightning_dynatrain.strategy.megatron_step import train_step

        strategy = self._strategy
        elastic, trainer = strategy.elastic, strategy.lightning_module.trainer
        if elastic is not None and elastic.snapshots is not None:  # what a recovery from a snapshot runs again
            elastic.snapshots.record(trainer.global_step + 1, batch, lr=lr, weight_decay=weight_decay)
        while True:
            progress = elastic.progress(trainer.global_step + 1) if elastic is not None else None
            try:
                loss = train_step(strategy.megatron, batch, strategy.recipe, lr=lr, weight_decay=weight_decay,
                                  progress=progress)
                if elastic is not None:
                    elastic.last_loss = (progress.step, loss)
                return loss
            except Exception as err:
                if elastic is None or not elastic.recovers(err):
                    raise
                outcome = elastic.recover(trainer, error=err, progress=progress)
            if not outcome.redo:
                return outcome.loss
            step_start_collectives(trainer)  # as the survivors that step through the loop

    def eval_step(self, batch: Mapping[str, torch.Tensor]) -> float:
        """The global mean loss of the global ``batch``, forward only, at the current layout; the
        same float on every rank, whatever the pipeline stage."""
        from lightning_dynatrain.strategy.megatron_step import eval_step

        strategy = self._strategy
        state = strategy.megatron_or_none
        if state is not None:
            return eval_step(state.ddp, state.groups, state.layout, batch, strategy.recipe)
        return eval_step(strategy.model_shard, strategy.groups, strategy.layout, batch, strategy.recipe)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step at the current layout: global // (dp * micro)."""
        from lightning_dynatrain.strategy.megatron_step import microbatches

        return microbatches(self._strategy.recipe, self._strategy.layout)

    def reduce(self, tensor: torch.Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> torch.Tensor | Any:
        """Reduce over the current layout's data-parallel group (``group=None``), or over ``group``."""
        if not isinstance(tensor, torch.Tensor) or self._local_collectives():
            return tensor
        state = self._strategy.megatron_or_none
        if group is None and state is not None:
            group = state.groups.dp_cp
        return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


__all__ = ["Stepping"]
