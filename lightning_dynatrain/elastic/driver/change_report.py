"""What one world change cost and moved (``elastic.driver.world_change.change_world``; ``OnNodeChange`` logs it)."""

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
    kept_world: bool = False
    """The new world was a kept one (``OnNodeChange(keep_worlds=...)``): no group was built for it."""

    def __str__(self) -> str:
        return (f"[dynatrain] step {self.step}: {self.change}, {self.src} -> {self.dst} in {self.pause_seconds:.3f} s "
                f"(transfer {self.transfer_seconds:.3f} s, {self.moved_bytes / 2**20:.1f} MiB; {self._built()}"
                f"{self._slowdown()}; detected {self.detect_to_swap_seconds:.2f} s before the swap). {self.reason}")

    def _built(self) -> str:
        """What was built in the background: the next world's group (or none: a kept world), the target."""
        target = None if self.ahead_build_seconds is None else f"{self.ahead_build_seconds:.3f} s"
        if self.kept_world:
            return "world kept from before (no group built)" + (
                "" if target is None else f", target built {target} in the background")
        return f"world built {self.build_seconds:.3f} s" + ("" if target is None else f" and its target {target}") + \
            " in the background"

    def _slowdown(self) -> str:
        return "" if self.overlap_slowdown is None else f", steps meanwhile {100 * self.overlap_slowdown:+.0f}%"


__all__ = ["ChangeReport"]
