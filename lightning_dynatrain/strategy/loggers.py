"""Loggers that continue when rank 0 changes: one version directory and one metrics file per run.

Lightning's file loggers write on rank 0 only, and pick their version lazily on the rank that logs:
the next free ``version_N`` under their root. In an elastic fit the process that is rank 0 changes
when rank 0 leaves, and its successor would pick ``version_{N+1}``; Lightning's ``CSVLogger``
would also delete the ``metrics.csv`` it finds there when its writer is made. So:

- every member takes rank 0's versions when it enters the job (the first world by a broadcast, a
  joiner in the header of its change): ``logger_versions`` / ``pin_logger_versions``;
- a rank 0 that leaves writes out what its loggers hold before it hands its state off and
  writes nothing after (``hand_off_loggers``: the rows it would log once the next rank 0 is
  chosen are that one's; a late write of its own would race the successor's take-over), and its
  successor takes the metrics file over as it stands (``continue_loggers``): its CSV writer starts
  from the file's columns and appends.

TensorBoard's writer starts a new event file in the same directory by itself. Loggers without a
version directory (e.g. WandB's run ids) are left as they are. Lightning's private attributes read
and set here are in ``compat.lightning_internals``.
"""

from __future__ import annotations

import csv
import os
import warnings
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from lightning_dynatrain.compat.lightning_internals import (csv_writer, has_version_directory, pin_version,
                                                            set_csv_writer)


def logger_versions(loggers: Sequence[Any]) -> list[Any]:
    """Each logger's version as this process would write it (``None`` for a logger without one)."""
    return [logger.version if has_version_directory(logger) else None for logger in loggers]


def pin_logger_versions(loggers: Sequence[Any], versions: Sequence[Any]) -> None:
    """Make each logger write to ``versions``' directory (rank 0's), whichever rank logs later."""
    if len(versions) != len(loggers):
        raise ValueError(f"{len(versions)} logger versions for {len(loggers)} loggers: the processes of one job "
                         "must configure the same loggers")
    for logger, version in zip(loggers, versions):
        if version is not None and has_version_directory(logger):
            pin_version(logger, version)


def hand_off_loggers(trainer: Any) -> None:
    """A rank 0 about to leave: write out what ``trainer``'s loggers hold, then detach them, so
    that nothing this process logs or finalizes later touches the files its successor continues."""
    for logger in trainer.loggers:
        logger.save()
    trainer.loggers = []


def continue_loggers(loggers: Sequence[Any]) -> None:
    """This process just became rank 0: take over each CSV metrics file as it stands."""
    for logger in loggers:
        if isinstance(logger, CSVLogger) and csv_writer(logger) is None:
            set_csv_writer(logger, _adopt_csv(logger.log_dir))


def _adopt_csv(log_dir: str) -> ExperimentWriter:
    """A CSV writer over ``log_dir`` that keeps its ``metrics.csv`` (Lightning's constructor deletes
    one it finds) and knows its columns, so that its rows append under the same header."""
    path = os.path.join(log_dir, ExperimentWriter.NAME_METRICS_FILE)
    aside = path + ".continued"
    kept = os.path.isfile(path)
    if kept:
        os.replace(path, aside)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Experiment logs directory")
            writer = ExperimentWriter(log_dir=log_dir)
    finally:
        if kept:
            os.replace(aside, path)
    if kept:
        with open(path, newline="") as f:
            writer.metrics_keys = sorted(next(csv.reader(f), []))
    return writer


__all__ = ["continue_loggers", "hand_off_loggers", "logger_versions", "pin_logger_versions"]
