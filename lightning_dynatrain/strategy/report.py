"""What a layout switch reports, and how it reaches the Trainer's loggers and the console.

The switch itself (``DynaTrainStrategy._switch_state``) returns *any* object with the
``SwitchFigures`` attributes for this rank. ``ReconfigReport.from_figures`` turns it into the job's
figures (max seconds and peak over ranks, summed bytes), which ``log_switch`` sends to every logger
of the Trainer and rank 0 prints as one line::

    [dynatrain] step 200: dp2-tp2-pp1 -> dp1-tp2-pp2 in 0.412 s, moved 12.0 MiB, retained 30.1 MiB, peak staging 4.0 MiB

Logged metrics (at ``step``): ``dynatrain/switch_seconds``, ``dynatrain/switch_<phase>_seconds``
per phase, ``dynatrain/moved_bytes``, ``dynatrain/retained_bytes``, ``dynatrain/peak_staging_bytes``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from lightning_dynatrain.engine.staging import format_bytes

if TYPE_CHECKING:
    import lightning.pytorch as pl


@runtime_checkable
class SwitchFigures(Protocol):
    """One rank's cost of one switch; what ``_switch_state`` returns."""

    seconds: float
    """Wall time of the whole switch on this rank."""
    phase_seconds: Mapping[str, float]
    """Seconds per phase (e.g. ``plan``, ``transfer``, ``rebuild``)."""
    moved_bytes: int
    """Bytes this rank sent to other ranks."""
    retained_bytes: int
    """Bytes this rank copied locally from its old storage to its new one."""
    peak_staging_bytes: int
    """Most bytes of staging buffers alive at once on this rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFigures:
    """A plain ``SwitchFigures`` (for the no-op switch, tests, and adapters)."""

    seconds: float = 0.0
    phase_seconds: Mapping[str, float] = field(default_factory=dict)
    moved_bytes: int = 0
    retained_bytes: int = 0
    peak_staging_bytes: int = 0


def figures_from_engine_report(report: Any, *, seconds: float | None = None,
                               extra_phases: Mapping[str, float] | None = None) -> RankFigures:
    """Adapt the engine's ``SwitchReport`` (``total_seconds``, ``seconds`` = per-phase dict,
    ``sent_bytes``, ``retained_bytes``, ``peak_staging_bytes``) to ``SwitchFigures``.

    ``extra_phases`` adds strategy-side phases (e.g. ``rebuild``: megatron groups, model, DDP and
    optimizer of the target) to the per-phase seconds; ``seconds`` is the whole switch's wall time
    (default: the engine's total plus the extra phases).
    """
    phases = dict(report.seconds)
    extra = dict(extra_phases or {})
    phases.update(extra)
    return RankFigures(
        seconds=float(seconds) if seconds is not None else float(report.total_seconds) + sum(extra.values()),
        phase_seconds=phases,
        moved_bytes=int(report.sent_bytes),
        retained_bytes=int(report.retained_bytes),
        peak_staging_bytes=int(report.peak_staging_bytes),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ReconfigReport:
    """The job's figures for one ``reconfigure`` (identical on every rank).

    Attributes:
        step: optimizer steps done when the switch ran (``trainer.global_step``).
        src, dst: layouts before and after, printed; equal for a no-op.
        seconds: the slowest rank's wall time.
        phase_seconds: per phase, the slowest rank's seconds.
        moved_bytes: bytes sent between ranks, summed over ranks.
        retained_bytes: bytes copied locally, summed over ranks.
        peak_staging_bytes: the largest per-rank staging peak.
        deferred: the request came in during a training step and ran at its end.
    """

    step: int
    src: str
    dst: str
    seconds: float = 0.0
    phase_seconds: Mapping[str, float] = field(default_factory=dict)
    moved_bytes: int = 0
    retained_bytes: int = 0
    peak_staging_bytes: int = 0
    deferred: bool = False

    @property
    def noop(self) -> bool:
        return self.src == self.dst

    @classmethod
    def from_figures(cls, figures: SwitchFigures, *, step: int, src: str, dst: str, deferred: bool = False,
                     group: dist.ProcessGroup | None = None) -> "ReconfigReport":
        """Combine every rank's ``figures`` into the job's (a collective over ``group``, WORLD by default;
        without ``torch.distributed`` the local figures are the job's)."""
        phases = sorted(figures.phase_seconds)
        maxed = torch.tensor([figures.seconds, float(figures.peak_staging_bytes),
                              *(figures.phase_seconds[p] for p in phases)], dtype=torch.float64)
        summed = torch.tensor([figures.moved_bytes, figures.retained_bytes], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized():
            device = _collective_device(group)
            maxed, summed = maxed.to(device), summed.to(device)
            dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
            maxed, summed = maxed.cpu(), summed.cpu()
        return cls(
            step=step, src=src, dst=dst, deferred=deferred,
            seconds=float(maxed[0]),
            peak_staging_bytes=int(maxed[1]),
            phase_seconds={p: float(v) for p, v in zip(phases, maxed[2:].tolist())},
            moved_bytes=int(summed[0]),
            retained_bytes=int(summed[1]),
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``switches.jsonl`` rows)."""
        return {"step": self.step, "src": self.src, "dst": self.dst, "seconds": self.seconds,
                "phase_seconds": dict(self.phase_seconds), "moved_bytes": self.moved_bytes,
                "retained_bytes": self.retained_bytes, "peak_staging_bytes": self.peak_staging_bytes,
                "deferred": self.deferred}

    def metrics(self) -> dict[str, float]:
        """The figures as logger metrics (see module docstring for the names)."""
        out = {"dynatrain/switch_seconds": self.seconds}
        out.update({f"dynatrain/switch_{p}_seconds": s for p, s in self.phase_seconds.items()})
        out["dynatrain/moved_bytes"] = float(self.moved_bytes)
        out["dynatrain/retained_bytes"] = float(self.retained_bytes)
        out["dynatrain/peak_staging_bytes"] = float(self.peak_staging_bytes)
        return out

    def __str__(self) -> str:
        if self.noop:
            return f"[dynatrain] step {self.step}: already at {self.dst}, nothing to do"
        note = " (deferred to the step boundary)" if self.deferred else ""
        return (f"[dynatrain] step {self.step}: {self.src} -> {self.dst} in {self.seconds:.3f} s, moved "
                f"{format_bytes(self.moved_bytes)}, retained {format_bytes(self.retained_bytes)}, peak staging "
                f"{format_bytes(self.peak_staging_bytes)}{note}")


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


def dumps(report: ReconfigReport) -> str:
    """One ``switches.jsonl`` line."""
    return json.dumps(report.to_json(), sort_keys=True)


__all__ = ["RankFigures", "ReconfigReport", "SwitchFigures", "dumps", "figures_from_engine_report", "log_switch"]
