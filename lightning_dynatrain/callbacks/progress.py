"""``LayoutProgressBar``: Lightning's progress bar, with the layout and the last switch in its postfix.

A user watching a job that changes its parallel layout wants to see which layout it runs at now and
what the last switch cost, next to the step and the loss::

    Epoch 0:  52%|█████▏    | 125/240 [00:31<00:29, 3.9it/s, train/loss=2.410, layout=dp1-tp2-pp2-zero1, switch=0.11s]

Add it like any progress bar (``Trainer(callbacks=[LayoutProgressBar()])``; it replaces the default
one). The one line per switch on rank 0 (``runtime/reconfig_report.py``) still prints as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl


class LayoutProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` whose postfix adds ``layout`` (the current one) and ``switch`` (the last
    switch's seconds, once one ran). Under any other strategy it is the plain bar.

    Args:
        refresh_rate, process_position, leave: as for ``TQDMProgressBar``.
    """

    @override
    def get_metrics(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        strategy = trainer.strategy
        run = getattr(strategy, "run", None)  # a DynaTrainStrategy's TrainingRun
        layout = run.layout_or_none if run is not None else None  # None before setup_environment
        if layout is not None:
            items["layout"] = str(layout)
        history = getattr(strategy, "switch_history", None)
        if history:
            items["switch"] = f"{history[-1].seconds:.2f}s"
        return items


__all__ = ["LayoutProgressBar"]
