"""One metrics file across a change of rank 0 (``strategy/loggers.py``), with Lightning's own
``CSVLogger`` and ``Trainer``: the leaving rank 0 writes out and detaches its loggers, its successor
appends to the file as it stands, columns it adds included."""

from __future__ import annotations

import csv
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_dynatrain.strategy.loggers import continue_loggers, hand_off_loggers, pin_logger_versions


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_leaving_rank0_hands_its_file_to_the_next_and_writes_nothing_after(tmp_path) -> None:
    leaver = CSVLogger(tmp_path, name="metrics")
    trainer = Trainer(logger=leaver, accelerator="cpu", devices=1, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    for step in range(5):
        leaver.log_metrics({"train/loss": 10.0 - step}, step=step)  # buffered (flush_logs_every_n_steps 100)
    metrics = Path(leaver.log_dir) / "metrics.csv"
    assert not metrics.exists()

    hand_off_loggers(trainer)
    assert [int(r["step"]) for r in _rows(metrics)] == list(range(5))
    assert trainer.loggers == [] and trainer.logger is None  # the loop's later rows and its finalize go nowhere

    # the successor's logger would pick version_1 by itself: it takes rank 0's version, then the file
    successor = CSVLogger(tmp_path, name="metrics")
    pin_logger_versions([successor], [leaver.version])
    continue_loggers([successor])
    assert _rows(metrics), "taking the file over must not delete it (Lightning's writer does, made afresh)"
    for step in range(5, 8):
        successor.log_metrics({"train/loss": 10.0 - step, "dynatrain/world_size": 3.0}, step=step)  # a new column
    successor.save()
    rows = _rows(metrics)
    assert [int(r["step"]) for r in rows] == list(range(8))
    assert [r["dynatrain/world_size"] for r in rows] == [""] * 5 + ["3.0"] * 3
    assert [float(r["train/loss"]) for r in rows] == [10.0 - s for s in range(8)]
    assert sorted(p.name for p in Path(tmp_path, "metrics").iterdir()) == ["version_0"]
