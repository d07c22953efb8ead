"""What one world change cost and moved (``ElasticDriver.change_world``; ``OnNodeChange`` logs it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ChangeReport:
    """What one world change cost and moved (the same on every process that stays)."""

    step: int
    change: str
    src: str
    dst: str
    reason: str
    detect_to_swap_seconds: float
    pause_seconds: float
    transfer_seconds: float
    build_seconds: float
    rebuild_seconds: float
    """Building the target's groups, model, DDP and optimizer inside the pause (on demand), or
    binding the ones built ahead."""
    moved_bytes: int
    overlap_slowdown: float | None = None
    """Mean seconds of the steps run while the next world was built (from the change's detection to
    its boundary) over the median of the 10 steps before, minus 1; ``None`` without both."""
    ahead_build_seconds: float | None = None
    """The target's model, DDP and optimizer built ahead in the background (``None``: in the pause)."""

    def __str__(self) -> str:
        return (f"[dynatrain] step {self.step}: {self.change}, {self.src} -> {self.dst} in {self.pause_seconds:.3f} s "
                f"(transfer {self.transfer_seconds:.3f} s, {self.moved_bytes / 2**20:.1f} MiB; world built "
                f"{self.build_seconds:.3f} s{self._target()} in the background{self._slowdown()}; detected "
                f"{self.detect_to_swap_seconds:.2f} s before the swap). {self.reason}")

    def _target(self) -> str:
        return "" if self.ahead_build_seconds is None else f" and its target {self.ahead_build_seconds:.3f} s"

    def _slowdown(self) -> str:
        return "" if self.overlap_slowdown is None else f", steps meanwhile {100 * self.overlap_slowdown:+.0f}%"


__all__ = ["ChangeReport"]
