"""``Stepping``: ``DynaTrainStrategy``'s training-step entry point and the reduce of what it logs.

``DynaTrainStrategy`` owns one and hands it ``train_step`` (called from a LightningModule's
``training_step``) and Lightning's ``reduce`` (over the current layout's data-parallel group). When
a switch requested during a step runs: ``switch_requests.py``; the step itself is the run's
(``TrainingRun.train_step``).

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
from lightning_dynatrain.elastic.driver.recovery import step_recovering

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from lightning_dynatrain.elastic.driver.driver import ElasticDriver
    from lightning_dynatrain.runtime.training_run import TrainingRun
    from lightning_dynatrain.strategy.optimizer_handle import DynaTrainOptimizer


class Stepping:
    """The training-step entry point of ``DynaTrainStrategy`` (see the module docstring).

    Args:
        run: the run that steps.
        handle: Lightning's optimizer handle (its schedule group holds the step's rate).
        elastic: the run's elastic driver, or ``None``: a member lost in a step is recovered from.
        trainer: the running trainer (the strategy's ``_running_trainer``).
        local_collectives: whether the collectives Lightning asks for are local no-ops now (the
            strategy's ``_collectives_are_local``).
    """

    def __init__(self, run: "TrainingRun", *, handle: "Callable[[], DynaTrainOptimizer]",
                 elastic: "Callable[[], ElasticDriver | None]", trainer: "Callable[[], pl.Trainer | None]",
                 local_collectives: Callable[[], bool]) -> None:
        self._run = run
        self._handle = handle
        self._elastic = elastic
        self._trainer = trainer
        self._local_collectives = local_collectives

    def train_step(self, optimizer: "LightningOptimizer", batch: Mapping[str, torch.Tensor], *,
                   lr: float | None = None, weight_decay: float | None = None,
                   forward_step: Callable | None = None) -> float:
        """One optimizer step over the global ``batch``, through Lightning's ``optimizer`` (so that
        Lightning counts it); the global mean loss. ``lr`` / ``weight_decay``: this step's values;
        ``None``: what the optimizer's schedule group holds. ``forward_step``: this step's, or the model's."""
        scheduled_lr, scheduled_wd = self._handle().scheduled
        closure = partial(self.optimizer_step, batch, lr=scheduled_lr if lr is None else lr,
                          weight_decay=scheduled_wd if weight_decay is None else weight_decay,
                          forward_step=forward_step)
        return optimizer.step(closure=closure)

    def optimizer_step(self, batch: Mapping[str, torch.Tensor], *, lr: float, weight_decay: float,
                       forward_step: Callable | None = None) -> float:
        """The megatron step; under ``OnNodeChange``, a member lost in it is recovered from
        (``elastic.driver.recovery.step_recovering``, under the one guard) and the step runs again at
        the survivors' layout on the same global batch, or counts as done where its result survived."""
        elastic, trainer = self._elastic(), self._trainer()
        if elastic is None:
            return self._run.train_step(batch, lr=lr, weight_decay=weight_decay, forward_step=forward_step)
        assert trainer is not None
        return step_recovering(elastic, trainer.global_step + 1, batch, lr=lr, weight_decay=weight_decay,
                               forward_step=forward_step,
                               before_redo=lambda: step_start_collectives(trainer))  # as the loop's steps

    def reduce(self, tensor: torch.Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> torch.Tensor | Any:
        """Reduce over the current layout's data-parallel group (``group=None``), or over ``group``."""
        if not isinstance(tensor, torch.Tensor) or self._local_collectives():
            return tensor
        state = self._run.state_or_none
        if group is None and state is not None:
            group = state.groups.dp_cp
        return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


__all__ = ["Stepping"]
