"""A Lightning callback that ends a fit at the step the job's store names, the same step on every rank.

The driver of an elastic job (a test, a benchmark) writes ``STOP_KEY`` into the job's store once the
fit has shown what it is run for, e.g. ``store.set(STOP_KEY, str(step + 8))``; each rank reads it
after each step and stops once its ``global_step`` reaches it. Given to any Lightning fit, including
the examples' command lines: ``--trainer.callbacks+=benchmarks.stop_in_store.StopInStore`` (with
the repository on ``PYTHONPATH``).
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

STOP_KEY = "bench/stop_at"


class StopInStore(Callback):
    """End the fit at the step the job's store names under ``STOP_KEY``."""

    def __init__(self) -> None:
        self.store = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.store is None:
            from lightning_dynatrain.elastic.client import JobStore

            self.store = JobStore.from_environment().store
        if self.store.check([STOP_KEY]) and trainer.global_step >= int(self.store.get(STOP_KEY)):
            trainer.should_stop = True
