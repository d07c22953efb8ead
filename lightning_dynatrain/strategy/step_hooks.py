"""``DynaTrainStrategy``'s training-step entry points: ``train_step`` and ``eval_step`` (called from
a LightningModule's ``training_step`` / ``validation_step``), Lightning's ``training_step`` hook
(which runs a switch requested during the step at its end) and ``reduce`` over the current layout's
data-parallel group.

The step itself is ``megatron_step``'s; when a switch runs, and why there: ``strategy/dynatrain.py``'s
module docstring.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from lightning.fabric.utilities.types import ReduceOp
from typing_extensions import override

from lightning_dynatrain.compat.lightning_internals import step_start_collectives, sync_ddp_if_available


class StepHooks:
    """The training-step entry points of ``DynaTrainStrategy`` (a mixin before its Lightning base).

    Reads the strategy's ``megatron`` state, ``recipe``, ``layout``, optimizer settings (``_optimizer_settings``),
    groups (``_pgs``), switcher (``_switcher``) and elastic driver (``_elastic``); sets the step flag
    (``_step_in_progress``) and runs a pending switch (``_run_pending``, ``SwitchHooks``).
    """

    def train_step(self, batch: Mapping[str, torch.Tensor], *, lr: float | None = None,
                   weight_decay: float | None = None) -> float:
        """One optimizer step over the global ``batch`` (call from ``training_step``); the global mean loss.

        ``lr`` / ``weight_decay``: this step's values (times each megatron group's multipliers);
        ``None``: what the optimizer's schedule group holds (``DynaTrainOptimizer``: the config's, or
        what a scheduler set). Lightning counts it as an optimizer step (``trainer.global_step`` advances).
        """
        handle = self._lightning_optimizers[0]
        scheduled_lr, scheduled_wd = self.optimizer_handle.scheduled
        closure = partial(self._optimizer_step, batch, lr=scheduled_lr if lr is None else lr,
                          weight_decay=scheduled_wd if weight_decay is None else weight_decay)
        return handle.step(closure=closure)

    def _optimizer_step(self, batch: Mapping[str, torch.Tensor], *, lr: float, weight_decay: float) -> float:
        """The megatron step; under ``OnNodeChange``, a member lost in it is recovered from here
        (``strategy/recovery.py``) and the step runs again at the survivors' layout on the same
        global batch, or counts as done where its result survived."""
        from lightning_dynatrain.strategy.megatron_step import train_step

        elastic = self._elastic
        if elastic is not None and elastic.snapshots is not None:  # what a recovery from a snapshot runs again
            elastic.snapshots.record(self.lightning_module.trainer.global_step + 1, batch, lr=lr,
                                     weight_decay=weight_decay)
        while True:
            progress = elastic.progress(self.lightning_module.trainer.global_step + 1) if elastic is not None else None
            try:
                loss = train_step(self.megatron, batch, self.recipe, lr=lr, weight_decay=weight_decay,
                                  progress=progress)
                if elastic is not None:
                    elastic.last_loss = (progress.step, loss)
                return loss
            except Exception as err:
                if elastic is None or not elastic.recovers(err):
                    raise
                outcome = elastic.recover(self.lightning_module.trainer, error=err, progress=progress)
            if not outcome.redo:
                return outcome.loss
            step_start_collectives(self.lightning_module.trainer)  # as the survivors that step through the loop

    def eval_step(self, batch: Mapping[str, torch.Tensor]) -> float:
        """The global mean loss of the global ``batch``, forward only, at the current layout (call
        from ``validation_step``); the same float on every rank, whatever the pipeline stage."""
        from lightning_dynatrain.strategy.megatron_step import eval_step

        assert self._pgs is not None, "setup_environment makes the groups"
        state = self._megatron
        if state is not None:
            return eval_step(state.ddp, state.groups, state.layout, batch, self.recipe)
        return eval_step(self.model_shard, self._pgs, self.layout, batch, self.recipe)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._step_in_progress = True
        beside_build, start = self._switcher is not None and self._switcher.building, time.perf_counter()
        try:
            output = super().training_step(*args, **kwargs)
        finally:
            self._step_in_progress = False
        if self._switcher is not None:  # what a switch built ahead cost the steps beside its build
            self._switcher.step_ran(time.perf_counter() - start, beside_build=beside_build)
        self._run_pending()  # a switch requested during the step runs now, at the boundary
        return output

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step at the current layout: global // (dp * micro)."""
        from lightning_dynatrain.strategy.megatron_step import microbatches

        return microbatches(self.recipe, self.layout)

    def _collectives_are_local(self) -> bool:
        return self._elastic is not None and self._elastic.local_collectives

    @override
    def reduce(self, tensor: torch.Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> torch.Tensor | Any:
        """Reduce over the current layout's data-parallel group (``group=None``), or over ``group``."""
        if not isinstance(tensor, torch.Tensor) or self._collectives_are_local():
            return tensor
        if group is None and self._megatron is not None:
            group = self._megatron.groups.dp_cp
        return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


__all__ = ["StepHooks"]
