"""``RunRecorder``: rank 0 writes a run's record and its pictures into one directory.

Files (``out`` is created; only rank 0 writes):

- ``metrics.csv``: ``step, loss, layout, seconds`` as each step ends (``seconds``: wall time since
  training started, so the step times are its differences and a switch shows in the step after it);
- ``switches.jsonl``: one JSON object per switch as it happens (``ReconfigReport.to_json``);
- at the end of training, ``loss.png`` (``viz.plot_loss``) and one ``transfers_step{N}.png`` per
  switch: the bytes every rank sent every other rank and kept, from the pure planner with this
  run's model, precision and ranks per node (``viz.transfer_matrix``).

The module must keep ``losses``, a list of ``(step, loss)`` (``GPTLightningModule`` does), and a
``shape`` (a ``GPTShape``) for the transfer pictures.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dynatrain.runtime.reconfig_report import ReconfigReport, dumps

if TYPE_CHECKING:
    import lightning.pytorch as pl


class RunRecorder(Callback):
    """Write ``metrics.csv``, ``switches.jsonl``, ``loss.png`` and a transfer picture per switch to ``out``.

    Args:
        out: the run's directory.
        pictures: draw ``loss.png`` and the transfer pictures at the end (needs matplotlib; without it
            the run says so and writes the rest).

    Attributes:
        rows: ``(step, loss, layout)`` of every step this process ran.
        switches: every switch's ``ReconfigReport``, in order.
        seconds: wall time of training (set at its end).
        pictures_written: the pictures written at the end (rank 0).
    """

    def __init__(self, out: str | Path, *, pictures: bool = True) -> None:
        self.out = Path(out)
        self.pictures = pictures
        self.rows: list[tuple[int, float, str]] = []
        self.switches: list[ReconfigReport] = []
        self.seconds = 0.0
        self.pictures_written: list[Path] = []
        self._layout = ""
        self._start = 0.0

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._start = time.perf_counter()
        if trainer.is_global_zero:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "switches.jsonl").write_text("")
            with open(self.out / "metrics.csv", "w", newline="") as f:
                csv.writer(f).writerow(["step", "loss", "layout", "seconds"])

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._flush_switches(trainer)
        self._layout = str(trainer.strategy.layout)  # the layout this step runs at

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step, loss = pl_module.losses[-1]
        self.rows.append((step, loss, self._layout))
        if trainer.is_global_zero:
            with open(self.out / "metrics.csv", "a", newline="") as f:
                csv.writer(f).writerow([step, f"{loss:.6f}", self._layout,
                                        f"{time.perf_counter() - self._start:.4f}"])

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._flush_switches(trainer)
        self.seconds = time.perf_counter() - self._start
        if trainer.is_global_zero and self.pictures and self.rows:
            from lightning_dynatrain.viz.figure import PlotError

            try:
                self._draw(trainer, pl_module)
            except PlotError as err:  # the run's files are written; only its pictures are missing
                rank_zero_info(f"[dynatrain] no pictures in {self.out}: {err}")

    def _flush_switches(self, trainer: "pl.Trainer") -> None:
        new = trainer.strategy.switch_history[len(self.switches):]
        self.switches.extend(new)
        if trainer.is_global_zero and new:
            with open(self.out / "switches.jsonl", "a") as f:
                f.writelines(dumps(r) + "\n" for r in new)

    def _draw(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        from lightning_dynatrain.viz.loss_plot import plot_loss

        self.pictures_written.append(plot_loss(self.out / "loss.png", self.rows, self.switches))
        shape = getattr(pl_module, "shape", None)
        if not self.switches:
            return
        if shape is None:
            rank_zero_info("[dynatrain] no transfer pictures: the LightningModule has no `shape` (a GPTShape)")
            return
        from lightning_dynatrain.megatron.gpt import logical_spec
        from lightning_dynatrain.megatron.state_bridge import precision_of
        from lightning_dynatrain.viz.transfer_matrix import transfer_matrix
        from lightning_dynatrain.viz.transfer_plot import plot_transfer_matrix
        from lightning_dynatrain.vps.layout import ParallelConfig

        strategy = trainer.strategy
        spec = logical_spec(shape)
        precision = precision_of(strategy.megatron.model, strategy.megatron.optimizer)
        for s in self.switches:
            matrix = transfer_matrix(spec, ParallelConfig.parse(s.src), ParallelConfig.parse(s.dst),
                                     precision=precision, gpus_per_node=max(1, strategy.num_processes))
            title = f"step {s.step}: {s.src} -> {s.dst} in {s.seconds:.2f} s ({precision.value} state)"
            self.pictures_written.append(plot_transfer_matrix(matrix, self.out / f"transfers_step{s.step}.png",
                                                              title=title))


__all__ = ["RunRecorder"]
