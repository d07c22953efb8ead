"""Layout switching for ``DynaTrainStrategy``: requests, checks, deferral, reports. The switch itself is
``_switch_state`` (one method: tear down layout A's megatron state, build B's, move the numbers).

When a switch runs. ``reconfigure(target)`` is collective (every rank, same step, same target) and
runs at the optimizer-step boundary: after optimizer step ``k``, before step ``k+1``'s forward.

- Called between training steps (``on_train_batch_end``/``on_train_batch_start`` hooks, e.g.
  ``ScheduledReconfig``, or ``on_train_start``): it runs at once and returns its report.
- Called while a training step runs (from ``training_step`` or a hook inside it, such as
  ``on_before_optimizer_step``): the target is recorded as pending, a line says it was deferred, and
  ``None`` is returned; it runs as that training step returns, right after its optimizer step and
  before the ``on_train_batch_end`` hooks. A second request in the same step replaces the first.

There is no gradient accumulation across ``training_step`` calls under this strategy: every call is
one whole optimizer step over the global batch (megatron's micro-batches inside it), so "mid
accumulation" means "inside a training step", and the end of the step is the next boundary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dynatrain.strategy.report import ReconfigReport, SwitchFigures, log_switch
from lightning_dynatrain.strategy.validation import validate_target
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache
    from lightning_dynatrain.strategy.config import AdamSettings, MegatronRecipe
    from lightning_dynatrain.strategy.megatron_step import MegatronState


class LayoutSwitching:
    """The switching half of ``DynaTrainStrategy`` (a mixin; the strategy provides the attributes below)."""

    _layout: ParallelConfig | None
    _recipe: "MegatronRecipe | None"
    _adam: "AdamSettings | None"
    _step_in_progress: bool
    _pending: ParallelConfig | None
    _groups: "ProcessGroupCache | None"
    switch_history: list[ReconfigReport]
    staging_budget: int
    switch_memory_limit: int | None
    world_size: int
    is_global_zero: bool
    layout: ParallelConfig
    recipe: "MegatronRecipe"
    megatron: "MegatronState"

    if TYPE_CHECKING:  # provided by DynaTrainStrategy
        def _install(self, state: "MegatronState") -> None: ...
        def _trainer(self) -> "pl.Trainer | None": ...
        def _global_step(self) -> int: ...

    def _run_pending(self) -> None:
        """Run a switch requested during the step that just ended (called as the training step returns)."""
        if self._pending is not None:
            target, self._pending = self._pending, None
            self._reconfigure_now(target, deferred=True)

    def check_layout(self, target: str | ParallelConfig) -> ParallelConfig:
        """Parse and check ``target`` against the world, the model and the batch; the layout or a typed error."""
        recipe = self._recipe
        return validate_target(target, world_size=self.world_size, current=self._layout,
                               shape=recipe.shape if recipe else None,
                               global_batch_size=recipe.global_batch_size if recipe else None,
                               micro_batch_size=recipe.micro_batch_size if recipe else None)

    def reconfigure(self, target: str | ParallelConfig) -> ReconfigReport | None:
        """Switch training to layout ``target`` at the optimizer-step boundary. Collective: every rank calls
        it at the same step with the same target.

        Returns:
            The switch's report, or ``None`` when the request came in during a training step: it is then
            pending and runs as that step returns (a later request replaces a pending one).

        Raises:
            LayoutError: the target is malformed or does not fit the model (the message names the rule).
            WorldSizeError: the target needs a different number of processes.
            BatchSizeError: the global batch does not split into micro-batches at the target.
        """
        layout = self.check_layout(target)
        if self._step_in_progress:
            if self._pending is not None and self._pending != layout:
                rank_zero_info(f"[dynatrain] pending switch to {self._pending} replaced by {layout}")
            self._pending = layout
            rank_zero_info(f"[dynatrain] switch to {layout} requested during step {self._global_step() + 1}: "
                           "deferred to the end of the step (after its optimizer step)")
            return None
        return self._reconfigure_now(layout, deferred=False)

    @property
    def pending_layout(self) -> ParallelConfig | None:
        """A switch requested during the running step, not yet done."""
        return self._pending

    def _reconfigure_now(self, layout: ParallelConfig, *, deferred: bool) -> ReconfigReport:
        src = self.layout
        if layout == src:
            report = ReconfigReport(step=self._global_step(), src=str(src), dst=str(src), deferred=deferred)
        else:
            figures = self._switch_state(layout)
            report = ReconfigReport.from_figures(figures, step=self._global_step(), src=str(src), dst=str(layout),
                                                 deferred=deferred)
            self.switch_history.append(report)
        log_switch(self._trainer(), report, is_global_zero=self.is_global_zero)
        return report

    def _switch_state(self, target: ParallelConfig) -> SwitchFigures:
        """Move every piece of training state from the current layout to ``target``; this rank's figures.

        ``megatron.hot_switch`` plans, rebuilds the target's megatron model, DDP buffers and optimizer
        (no weight init) and lets the engine fill them; ``_install`` then points the LightningModule's
        ``model`` and Lightning's optimizer handle at the new objects. The data pipeline needs nothing
        (global batches; the next step slices by the new dp), and the learning rate is a function of
        ``trainer.global_step``. With ``verify`` the logical state is fingerprinted on both sides
        (collective) and a mismatch raises ``SwitchVerificationError``.
        """
        from lightning_dynatrain.megatron.hot_switch import MegatronTrainingState, hot_switch
        from lightning_dynatrain.strategy.megatron_step import optimizer_kwargs, state_of
        from lightning_dynatrain.strategy.report import figures_from_engine_report

        old = self.megatron
        current = MegatronTrainingState(layout=old.layout, ddp=old.ddp, optimizer=old.optimizer)
        before = self._fingerprint(current) if self.verify else None
        result = hot_switch(current, target, shape=self.recipe.shape, seed=self.recipe.seed,
                            staging_budget=self.staging_budget, optimizer_kwargs=optimizer_kwargs(self._adam),
                            groups=self._groups, memory_limit=self.switch_memory_limit)
        del current, old
        if before is not None:
            after = self._fingerprint(result.state)
            if after != before:
                from lightning_dynatrain.engine.fingerprint import diff

                raise SwitchVerificationError(
                    f"the logical state changed in the switch to {target}: {'; '.join(diff(before, after))}",
                    hint="this is a bug in lightning-dynatrain; please report it with the two layouts")
        self._install(state_of(target, result.state.ddp, result.state.optimizer, self.recipe))
        return figures_from_engine_report(result.report, seconds=result.seconds,
                                          extra_phases={"rebuild": result.rebuild_seconds})

    def _fingerprint(self, state) -> dict:
        """Layout-independent fingerprint of the full logical state (collective)."""
        import torch.distributed as dist

        from lightning_dynatrain.engine.fingerprint import logical_fingerprint
        from lightning_dynatrain.megatron.gpt import logical_spec
        from lightning_dynatrain.megatron.state_bridge import (
            adam_step,
            materialize_adam_state,
            megatron_store,
            precision_of,
        )

        if adam_step(state.optimizer) is None:  # before the first step: zero moments, as hot_switch makes them
            materialize_adam_state(state.optimizer, 0)
        spec = logical_spec(self.recipe.shape)
        rank = dist.get_rank()
        store = megatron_store(state.ddp, state.optimizer, spec, state.layout, rank)
        return logical_fingerprint(store, spec, state.layout, rank, precision_of(state.ddp.module))


class SwitchVerificationError(RuntimeError):
    """``verify=True`` found the logical state different after a switch (a bug, never a user error)."""

    def __init__(self, message: str, *, hint: str) -> None:
        super().__init__(f"{message}. HINT: {hint}")


__all__ = ["LayoutSwitching", "SwitchVerificationError"]
