"""How much a background build slowed the training steps it ran beside.

The next world (``elastic/driver/driver.py``) and a switch built ahead (``megatron/ahead.py``) are built
in a background thread while training steps on: the steps then share the cores (and the GIL) with
the build. ``OverlapClock`` keeps the seconds of recent steps that ran alone and of those that ran
beside a build; the slowdown is the latter's mean over the former's median, minus 1.
"""

from __future__ import annotations

import statistics
from collections import deque


class OverlapClock:
    """Step seconds, with or without a background build beside them (one per driver)."""

    def __init__(self, steady_window: int = 10) -> None:
        self._steady: deque[float] = deque(maxlen=steady_window)  # the last steps with no build beside
        self._overlapped: list[float] = []  # the steps beside the current build

    def add(self, seconds: float, *, overlapped: bool) -> None:
        (self._overlapped if overlapped else self._steady).append(seconds)

    def slowdown(self) -> float | None:
        """Mean seconds of the steps beside the build over the median of the steady ones, minus 1
        (``None`` without both); the overlapped steps are forgotten (the next build starts afresh)."""
        overlapped, self._overlapped = self._overlapped, []
        if not overlapped or not self._steady:
            return None
        return statistics.fmean(overlapped) / statistics.median(self._steady) - 1


__all__ = ["OverlapClock"]
