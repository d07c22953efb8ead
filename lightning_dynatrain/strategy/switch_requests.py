"""``SwitchRequests``: when ``DynaTrainStrategy``'s layout switches run, and how each is logged.

``DynaTrainStrategy`` owns one and hands it its switching entry points (``reconfigure``,
``prepare_reconfigure``, ``pending_layout``, ``switch_history``) and Lightning's ``training_step``
hook, around which a requested switch waits for the step boundary.

Layout switches run at the optimizer-step boundary: after optimizer step ``k``, before step
``k+1``'s forward. Requested between training steps (``on_train_batch_end`` /
``on_train_batch_start`` hooks, e.g. ``ScheduledReconfig``), a switch runs at once; requested while
a training step runs (from ``training_step`` or a hook inside it), the target is recorded as pending
and runs as that step returns, before the ``on_train_batch_end`` hooks (a second request in the same
step replaces the first). Every ``training_step`` is one whole optimizer step over the global batch
(megatron's micro-batches inside it), so "mid accumulation" means "inside a training step". The
check of the target and the switch itself are the run's (``TrainingRun.check``, ``TrainingRun.switch``);
each switch's report goes to the Trainer's loggers and rank 0 prints its line (``log_switch``).
A rollout phase (``rollout``) is the run's too (``TrainingRun.rollout``); here a snapshot in flight
ends first, as before a switch, and rank 0 prints the phase's two transitions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dynatrain.elastic.driver.recovery import rollout_recovering, switch_recovering
from lightning_dynatrain.runtime.reconfig_report import ReconfigReport
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dynatrain.elastic.driver.driver import ElasticDriver
    from lightning_dynatrain.runtime.rollout import RolloutPolicy
    from lightning_dynatrain.runtime.training_run import TrainingRun

T = TypeVar("T")


class SwitchRequests:
    """Runs each requested switch at the optimizer-step boundary (see the module docstring).

    Args:
        run: the run whose layout it switches.
        elastic: the run's elastic driver, or ``None`` (the strategy's ``elastic``): a member lost in
            a switch is recovered from, and a switch waits for a world change built ahead.
        trainer: the running trainer, ``None`` outside a fit (the strategy's ``_running_trainer``).
    """

    def __init__(self, run: "TrainingRun", *, elastic: "Callable[[], ElasticDriver | None]",
                 trainer: "Callable[[], pl.Trainer | None]") -> None:
        self._run = run
        self._elastic = elastic
        self._trainer = trainer
        self.pending: ParallelConfig | None = None
        """A switch requested during the running step, not yet done."""
        self.in_step = False
        """A training step is running (a switch requested now waits for its end)."""
        self.history: list[ReconfigReport] = []
        """Every switch that ran (no-ops excluded), in order; the same on every rank."""

    def _global_step(self) -> int:
        trainer = self._trainer()
        return trainer.global_step if trainer is not None else 0

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
            Each of these on every rank, before anything moved (``transition.errors.was_refused``):
            training can go on at the old layout.
        """
        layout = self._run.check(target)
        if self.in_step:
            if self.pending is not None and self.pending != layout:
                rank_zero_info(f"[dynatrain] pending switch to {self.pending} replaced by {layout}")
            self.pending = layout
            rank_zero_info(f"[dynatrain] switch to {layout} requested during step {self._global_step() + 1}: "
                           "deferred to the end of the step (after its optimizer step)")
            return None
        return self.reconfigure_now(layout, deferred=False)

    def run_step(self, step: Callable[[], T]) -> T:
        """Run one training step (Lightning's ``training_step``); a switch requested during it runs as
        it returns, at the boundary."""
        from lightning_dynatrain.runtime.rollout import RolloutInterrupted

        switcher = self._run.switcher
        self.in_step = True
        beside_build, start = switcher.building, time.perf_counter()
        try:
            while True:
                try:
                    output = step()
                    break
                except RolloutInterrupted as err:  # the survivors went on: the step again, from its start
                    rank_zero_info(f"[dynatrain] {err}")
        finally:
            self.in_step = False
        switcher.step_ran(time.perf_counter() - start, beside_build=beside_build)  # what a build ahead cost
        if self.pending is not None:  # requested during the step that just ended
            target, self.pending = self.pending, None
            self.reconfigure_now(target, deferred=True)
        return output

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
        if self._elastic() is not None or self.in_step:
            return False
        layout = self._run.check(target)
        started = self._run.prepare(layout)
        if started:
            rank_zero_info(f"[dynatrain] building the switch {self._run.layout} -> {layout} ahead, in the background")
        return started

    def reconfigure_now(self, layout: ParallelConfig, *, deferred: bool) -> ReconfigReport:
        """Switch to the checked ``layout`` now (``deferred``: it was requested during the step that
        just ended); under ``OnNodeChange``, a member lost in the switch is recovered from here."""
        run, step, elastic = self._run, self._global_step(), self._elastic()
        if elastic is None:
            report = run.switch(layout, step=step, deferred=deferred)
        else:
            report, lost = switch_recovering(elastic, layout, step=step, deferred=deferred)
            if lost:  # the survivors went on at their world's layout (the recovery logged it)
                return report
        if not report.noop:
            self.history.append(report)
        log_switch(self._trainer(), report, is_global_zero=not dist.is_initialized() or dist.get_rank() == 0)
        return report

    @contextmanager
    def rollout(self, layout: str | ParallelConfig, *, park: str, keep_weights: bool) -> "Iterator[RolloutPolicy]":
        """``TrainingRun.rollout`` between two steps; rank 0 prints both transitions. Under ``OnNodeChange``
        a member lost in the phase is recovered from (``recovery.rollout_recovering``), and its
        ``RolloutInterrupted`` makes ``run_step`` run the training step again."""
        elastic, step = self._elastic(), self._global_step()
        phase = self._run.rollout(layout, park=park, keep_weights=keep_weights) if elastic is None else \
            rollout_recovering(elastic, layout, park=park, keep_weights=keep_weights, step=step)
        with phase as policy:
            figures = policy.figures
            rank_zero_info(f"[dynatrain] step {step}: rollout at {policy.layout}, weights moved in "
                           f"{figures.enter_seconds:.2f} s, {figures.parked_bytes / 2**20:.1f} MiB parked")
            yield policy
        rank_zero_info(f"[dynatrain] step {step}: back at {self._run.layout} from the rollout in "
                       f"{policy.figures.leave_seconds:.2f} s")

    def close(self) -> None:
        """Forget a pending switch (the run ends)."""
        self.pending = None


def log_switch(trainer: "pl.Trainer | None", report: ReconfigReport, *, is_global_zero: bool) -> None:
    """Send ``report`` to every logger of ``trainer`` (at its step) and print its line on rank 0.

    Loggers write on rank 0 only (Lightning's loggers are rank-zero-only); the print is guarded here.
    A no-op switch prints its line but logs no metrics.
    """
    if is_global_zero:
        print(str(report), flush=True)
    if trainer is None or report.noop:
        return
    metrics = report.metrics()
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=report.step)


__all__ = ["SwitchRequests", "log_switch"]
