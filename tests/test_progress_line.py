"""``ProgressLine``: silent for quick work, a line per report for slow work, rewritten in place on a terminal."""

from __future__ import annotations

import io
import time

from lightning_dynatrain.progress_line import ProgressLine


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quick_work_prints_nothing() -> None:
    out = io.StringIO()
    with ProgressLine("planning", after=1.0, stream=out) as line:
        line.update(1, 2)
    assert out.getvalue() == "" and line.reports == 0


def test_slow_work_reports_counts_and_the_total_time() -> None:
    out = io.StringIO()
    with ProgressLine("planning 8 ranks", after=0.05, every=0.05, stream=out) as line:
        for rank in range(8):
            time.sleep(0.03)
            line.update(rank + 1, 8)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3, lines
    assert any("planning 8 ranks: " in x and "/8 (" in x for x in lines[:-1])
    assert lines[-1].startswith("planning 8 ranks: done in ")


def test_on_a_terminal_the_line_is_rewritten_in_place() -> None:
    out = _Terminal()
    with ProgressLine("planning", after=0.0, every=0.02, stream=out):
        time.sleep(0.1)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, ended once
    assert text.count("\r") >= 2


def test_a_failure_says_stopped() -> None:
    out = io.StringIO()
    try:
        with ProgressLine("planning", after=0.0, every=1.0, stream=out):
            time.sleep(0.05)
            raise KeyError("x")
    except KeyError:
        pass
    assert "planning: stopped in" in out.getvalue()
