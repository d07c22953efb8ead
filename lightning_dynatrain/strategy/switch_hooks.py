"""``DynaTrainStrategy``'s switching entry points: ``reconfigure`` (now, or at the end of the running
step), ``prepare_reconfigure`` (a known next switch built ahead) and the checks they share.

When a switch runs, and why there: ``strategy/dynatrain.py``'s module docstring; the switch itself
is ``switching.LayoutSwitcher``'s.
"""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dynatrain.engine.errors import mark_refused
from lightning_dynatrain.strategy.report import ReconfigReport, log_switch
from lightning_dynatrain.strategy.validation import validate_target
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig


class SwitchHooks:
    """The switching entry points of ``DynaTrainStrategy`` (a mixin before its Lightning base).

    Reads the strategy's ``layout``, ``recipe``, ``megatron`` state, switcher (``_switcher``),
    optimizer settings (``_optimizer_settings``), pending target (``_pending``), step flag (``_step_in_progress``),
    elastic driver (``_elastic``) and ``switch_history``; ``_install`` makes a new state current.
    """

    def check_layout(self, target: str | ParallelConfig) -> ParallelConfig:
        """Parse and check ``target`` against the world, the model, the batch and the optimizer; the
        layout or a typed error."""
        recipe = self._recipe
        layout = validate_target(target, world_size=self.world_size, current=self._layout,
                                 model=recipe.model if recipe else None,
                                 global_batch_size=recipe.global_batch_size if recipe else None,
                                 micro_batch_size=recipe.micro_batch_size if recipe else None,
                                 execution=recipe.execution if recipe else None)
        if self._optimizer_settings is not None:
            from lightning_dynatrain.strategy.config import optimizer_config
            from lightning_dynatrain.strategy.validation import validate_optimizer

            validate_optimizer(optimizer_config(self._optimizer_settings), layout)
        return layout

    def reconfigure(self, target: str | ParallelConfig) -> ReconfigReport | None:
        """Switch training to layout ``target`` at the optimizer-step boundary (see the module docstring).
        Collective: every rank calls it at the same step with the same target.

        Returns:
            The switch's report, or ``None`` when the request came in during a training step: it is then
            pending and runs as that step returns (a later request replaces a pending one).

        Raises:
            LayoutError: the target is malformed or does not fit the model (the message names the rule).
            WorldSizeError: the target needs a different number of processes.
            BatchSizeError: the global batch does not split into micro-batches at the target.
            SwitchMemoryError, StagingBudgetError: the switch does not fit (memory, staging budget).
            Each of these on every rank, before anything moved (``engine.errors.was_refused``):
            training can go on at the old layout.
        """
        try:
            layout = self.check_layout(target)
        except DynaTrainError as err:
            raise mark_refused(err)
        if self._step_in_progress:
            if self._pending is not None and self._pending != layout:
                rank_zero_info(f"[dynatrain] pending switch to {self._pending} replaced by {layout}")
            self._pending = layout
            rank_zero_info(f"[dynatrain] switch to {layout} requested during step {self._global_step() + 1}: "
                           "deferred to the end of the step (after its optimizer step)")
            return None
        return self._reconfigure_now(layout, deferred=False)

    def _last_checkpoint(self) -> str | None:
        """The run's latest checkpoint: a ``ModelCheckpoint``'s last (else best) save, else the one
        this fit resumed from; ``None`` when there is none."""
        trainer = self._trainer()
        if trainer is None:
            return None
        for callback in trainer.checkpoint_callbacks:
            path = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
            if path:
                return str(path)
        return str(trainer.ckpt_path) if trainer.ckpt_path else None

    @property
    def pending_layout(self) -> ParallelConfig | None:
        """A switch requested during the running step, not yet done."""
        return self._pending

    def _run_pending(self) -> None:
        """Run a switch requested during the step that just ended (called as the training step returns)."""
        if self._pending is not None:
            target, self._pending = self._pending, None
            self._reconfigure_now(target, deferred=True)

    def prepare_reconfigure(self, target: str | ParallelConfig) -> bool:
        """Build the switch to ``target`` ahead, in the background, while training steps on: its
        program and megatron objects (``megatron.ahead``). The next ``reconfigure(target)`` from the
        current layout then pays only the transfer and the binding; a switch elsewhere drops it.
        Collective: every rank, between the same two steps (``ScheduledReconfig`` calls it for its
        next entry). Makes the target's groups here, if new.

        Returns:
            Whether a build started: not for the current layout, not during an elastic run (its
            worlds change under it), not in a world where a build failed once, not for a model whose
            modules read megatron's globals (``ModelProvider.builds_beside_training``).

        Raises:
            LayoutError, WorldSizeError, BatchSizeError: as ``reconfigure``.
        """
        if self._elastic is not None or self._step_in_progress:
            return False
        layout = self.check_layout(target)
        assert self._switcher is not None and self._optimizer_settings is not None
        started = self._switcher.prepare(self.megatron, layout, recipe=self.recipe, optimizer=self._optimizer_settings)
        if started:
            rank_zero_info(f"[dynatrain] building the switch {self.layout} -> {layout} ahead, in the background")
        return started

    def _reconfigure_now(self, layout: ParallelConfig, *, deferred: bool) -> ReconfigReport:
        src, step = self.layout, self._global_step()
        if layout != src and self._elastic is not None and self._elastic.preparing is not None:
            from lightning_dynatrain.strategy.elastic_ahead import WorldChangePendingError

            raise mark_refused(WorldChangePendingError(
                f"a switch to {layout} was asked for while a world change to {self._elastic.preparing} is built "
                f"ahead from {src}", hint="switch after the change (a step or two later), or build world changes "
                "in their pause: OnNodeChange(ahead=False)"))
        if layout == src:
            report = ReconfigReport(step=step, src=str(src), dst=str(src), deferred=deferred)
        else:
            assert self._switcher is not None and self._optimizer_settings is not None
            snapshots = self._elastic.snapshots if self._elastic is not None else None
            if snapshots is not None:
                snapshots.before_state_change()
            try:
                state, report = self._switcher.switch(self.megatron, layout, recipe=self.recipe,
                                                      optimizer=self._optimizer_settings, step=step, deferred=deferred)
            except Exception as err:  # a member died in the switch with the old state whole: survivors go on
                if self._elastic is None or not self._elastic.recovers(err):
                    raise
                self._elastic.recover(self._trainer(), error=err)
                return ReconfigReport(step=step, src=str(src), dst=str(self.layout), deferred=deferred)
            self._install(state)
            if snapshots is not None:
                snapshots.after_state_change(step)
            self.switch_history.append(report)
        log_switch(self._trainer(), report, is_global_zero=self.is_global_zero)
        return report


__all__ = ["SwitchHooks"]
