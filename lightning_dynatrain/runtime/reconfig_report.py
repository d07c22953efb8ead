"""What a layout switch reports: the job's figures of one switch, the same on every rank.

Each rank's ``HotSwitchResult`` (the engine's ``SwitchReport`` plus the rebuild's phases) becomes
the job's ``ReconfigReport`` (``ReconfigReport.gather``: max seconds and peak over ranks, summed
bytes). Front ends print its line (rank 0 or once per node) and log its ``metrics`` (the Lightning
strategy to the Trainer's loggers: ``strategy/switch_requests.py``)::

    [dynatrain] step 200: dp2-tp2-pp1 -> dp1-tp2-pp2 in 0.412 s, moved 12.0 MiB (inter-node 0 B, broadcast 0 B),
    retained 30.1 MiB (in place 20.0 MiB), peak staging 4.0 MiB

Logged metrics (at ``step``): ``dynatrain/switch_seconds``, ``dynatrain/switch_<phase>_seconds``
per phase (``PHASES``), and ``dynatrain/<figure>`` for each byte count (``BYTES``); for a switch
built ahead also ``dynatrain/switch_ahead_build_seconds`` and ``dynatrain/switch_overlap_slowdown``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_dynatrain.transition.comm import default_device
from lightning_dynatrain.transition.staging import format_bytes

if TYPE_CHECKING:
    from lightning_dynatrain.megatron.hot_switch import HotSwitchResult

#: a switch's phases: the hot switch's own (``plan``: its program; ``memory_check``; ``rebuild``:
#: the target's groups, model, DDP buffers and optimizer) and the engine's (``agree``: the checks
#: agreed on every rank before anything moves; ``allocate`` ... ``free``)
PHASES = ("plan", "memory_check", "rebuild", "agree", "allocate", "copy", "pack", "transfer", "unpack", "free")
#: ``gather``'s stand-in for a figure a rank does not have (``None``), below any real one in a MAX
_NONE = -1.0e30
#: the byte counts, summed over ranks: what crossed a process boundary (``moved``), of it across
#: nodes and by broadcast, what stayed (``retained``), of it kept in place (no copy)
BYTES = ("moved_bytes", "inter_node_bytes", "broadcast_bytes", "retained_bytes", "in_place_bytes")


def _rank_figures(result: "HotSwitchResult") -> tuple[dict[str, float], dict[str, int]]:
    """One rank's seconds per phase and byte counts."""
    r = result.report
    engine = dict(r.seconds)
    seconds = {"plan": result.phases.get("plan", 0.0), "memory_check": result.phases.get("memory_check", 0.0),
               "rebuild": result.rebuild_seconds, "agree": engine.pop("plan")} | engine
    counts = {"moved_bytes": r.sent_bytes, "inter_node_bytes": r.sent_inter_node_bytes,
              "broadcast_bytes": r.recv_broadcast_bytes,
              "retained_bytes": r.retained_bytes, "in_place_bytes": r.in_place.bytes}
    return seconds, counts


@dataclass(frozen=True, kw_only=True, slots=True)
class ReconfigReport:
    """The job's figures for one ``reconfigure`` (identical on every rank).

    Attributes:
        step: optimizer steps done when the switch ran (``trainer.global_step``).
        src, dst: layouts before and after, printed; equal for a no-op.
        seconds: the slowest rank's wall time.
        phase_seconds: per phase (``PHASES``), the slowest rank's seconds.
        moved_bytes ... in_place_bytes: ``BYTES``, summed over ranks.
        peak_staging_bytes: the largest per-rank staging peak.
        deferred: the request came in during a training step and ran at its end.
        ahead_build_seconds: built ahead (``prepare_reconfigure``): the slowest rank's background
            build (not in ``seconds``); ``None``: built on demand, inside the pause.
        overlap_slowdown: built ahead: how much slower the training steps beside the build ran
            than the steps before it (``step_clock.OverlapClock``, the slowest rank); ``None``
            when not known.
    """

    step: int
    src: str
    dst: str
    seconds: float = 0.0
    phase_seconds: Mapping[str, float] = field(default_factory=dict)
    moved_bytes: int = 0
    inter_node_bytes: int = 0
    broadcast_bytes: int = 0
    retained_bytes: int = 0
    in_place_bytes: int = 0
    peak_staging_bytes: int = 0
    deferred: bool = False
    ahead_build_seconds: float | None = None
    overlap_slowdown: float | None = None

    @property
    def noop(self) -> bool:
        return self.src == self.dst

    @classmethod
    def gather(cls, result: "HotSwitchResult", *, step: int, deferred: bool = False,
               group: dist.ProcessGroup | None = None, overlap_slowdown: float | None = None) -> "ReconfigReport":
        """The job's report from every rank's ``result`` (a collective over ``group``, WORLD by
        default; without ``torch.distributed`` the local figures are the job's). ``overlap_slowdown``:
        this rank's (``OverlapClock.slowdown``)."""
        seconds, counts = _rank_figures(result)
        ahead = _NONE if result.ahead_build_seconds is None else result.ahead_build_seconds
        slowdown = _NONE if overlap_slowdown is None else overlap_slowdown
        maxed = torch.tensor([result.seconds, float(result.report.peak_staging_bytes), ahead, slowdown,
                              *(seconds[p] for p in PHASES)], dtype=torch.float64)
        summed = torch.tensor([counts[b] for b in BYTES], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized():
            device = default_device(group)
            maxed, summed = maxed.to(device), summed.to(device)
            dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
            maxed, summed = maxed.cpu(), summed.cpu()
        ahead, slowdown = (None if float(v) == _NONE else float(v) for v in maxed[2:4])
        return cls(step=step, src=result.report.src, dst=result.report.dst, deferred=deferred,
                   seconds=float(maxed[0]), peak_staging_bytes=int(maxed[1]), ahead_build_seconds=ahead,
                   overlap_slowdown=slowdown, phase_seconds=dict(zip(PHASES, maxed[4:].tolist())),
                   **dict(zip(BYTES, (int(x) for x in summed.tolist()))))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``switches.jsonl`` rows)."""
        return {"step": self.step, "src": self.src, "dst": self.dst, "seconds": self.seconds,
                "phase_seconds": dict(self.phase_seconds), "peak_staging_bytes": self.peak_staging_bytes,
                "deferred": self.deferred, "ahead_build_seconds": self.ahead_build_seconds,
                "overlap_slowdown": self.overlap_slowdown, **{b: getattr(self, b) for b in BYTES}}

    def metrics(self) -> dict[str, float]:
        """The figures as logger metrics (see module docstring for the names)."""
        out = {"dynatrain/switch_seconds": self.seconds}
        out.update({f"dynatrain/switch_{p}_seconds": s for p, s in self.phase_seconds.items()})
        out.update({f"dynatrain/{b}": float(getattr(self, b)) for b in BYTES})
        out["dynatrain/peak_staging_bytes"] = float(self.peak_staging_bytes)
        if self.ahead_build_seconds is not None:
            out["dynatrain/switch_ahead_build_seconds"] = self.ahead_build_seconds
        if self.overlap_slowdown is not None:
            out["dynatrain/switch_overlap_slowdown"] = self.overlap_slowdown
        return out

    def __str__(self) -> str:
        if self.noop:
            return f"[dynatrain] step {self.step}: already at {self.dst}, nothing to do"
        note = " (deferred to the step boundary)" if self.deferred else ""
        if self.ahead_build_seconds is not None:
            beside = "" if self.overlap_slowdown is None else f", steps beside it {100 * self.overlap_slowdown:+.0f}%"
            note += f"; built ahead in {self.ahead_build_seconds:.2f} s in the background{beside}"
        return (f"[dynatrain] step {self.step}: {self.src} -> {self.dst} in {self.seconds:.3f} s, moved "
                f"{format_bytes(self.moved_bytes)} (inter-node {format_bytes(self.inter_node_bytes)}, broadcast "
                f"{format_bytes(self.broadcast_bytes)}), retained {format_bytes(self.retained_bytes)} (in place "
                f"{format_bytes(self.in_place_bytes)}), peak staging {format_bytes(self.peak_staging_bytes)}{note}")


def dumps(report: ReconfigReport) -> str:
    """One ``switches.jsonl`` line."""
    return json.dumps(report.to_json(), sort_keys=True)


__all__ = ["BYTES", "PHASES", "ReconfigReport", "dumps"]
