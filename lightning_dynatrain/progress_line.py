"""A progress line on stderr for work that may take a while, and nothing for work that does not.

``dynatrain plan`` plans every rank of a switch; at 1024 ranks of a large MoE that takes seconds,
during which a user would otherwise see nothing. ``ProgressLine`` stays silent for the first
``after`` seconds (most plans finish sooner), then reports every ``every`` seconds from a
background thread: rewritten in place on a terminal, one line per report otherwise (a log file or
a test's captured output), and a last line with the total time.

Example::

    with ProgressLine("planning 1024 ranks") as line:
        for rank in range(1024):
            ...
            line.update(rank + 1, 1024)
    # after 1 s, on stderr:  planning 1024 ranks: 512/1024 (50%), 1.0 s
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO


class ProgressLine:
    """Reports ``label`` (and ``done/total`` when ``update`` is called) once the work passes ``after`` seconds.

    Args:
        label: what is being done, e.g. ``"planning qwen-moe-235b on 1024 ranks"``.
        after: seconds of silence before the first report.
        every: seconds between reports.
        stream: where to write (default ``sys.stderr``, so ``--json`` output on stdout stays clean).
    """

    def __init__(self, label: str, *, after: float = 1.0, every: float = 1.0, stream: TextIO | None = None) -> None:
        self.label = label
        self.after = after
        self.every = every
        self.stream = stream if stream is not None else sys.stderr
        self._done: int | None = None
        self._total: int | None = None
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: how many reports were written (0: the work finished within ``after``)
        self.reports = 0

    def update(self, done: int, total: int) -> None:
        """Record progress (cheap: the background thread writes)."""
        self._done, self._total = done, total

    def _text(self) -> str:
        elapsed = time.perf_counter() - self._start
        if self._done is not None and self._total:
            return f"{self.label}: {self._done}/{self._total} ({100 * self._done // self._total}%), {elapsed:.1f} s"
        return f"{self.label}: {elapsed:.1f} s"

    def _tty(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def _write(self, text: str, *, final: bool = False) -> None:
        with self._lock:
            if self._tty():
                self.stream.write(f"\r\x1b[2K{text}" + ("\n" if final else ""))
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
            self.reports += 1

    def _run(self) -> None:
        if self._stop.wait(self.after):
            return
        while True:
            self._write(self._text())
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> "ProgressLine":
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="dynatrain-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.reports:  # say that it ended, and how long it took
            elapsed = time.perf_counter() - self._start
            self._write(f"{self.label}: {'done' if exc_type is None else 'stopped'} in {elapsed:.1f} s", final=True)


__all__ = ["ProgressLine"]
