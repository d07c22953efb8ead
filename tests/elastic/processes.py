"""Separate processes started at different times, for world changes: no process group is made for
them (the code under test builds its worlds), unlike ``tests.dist.run_distributed``.

Example::

    procs = Processes()
    procs.start("a", _worker, address, 0)
    procs.start("b", _worker, address, 1)
    ...                                   # later: joiners
    procs.start("c", _joiner, address)
    results = procs.collect(timeout_s=120)   # {"a": ..., "b": ..., "c": ...}
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from benchmarks.baselines.launch import process_context, take_environment
from tests.dist import DistributedTestError


def _child(name: str, fn: Callable[..., Any], args: tuple, results: Any, environ: dict[str, str]) -> None:
    take_environment(environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        results.put((name, "ok", fn(name, *args)))
    except BaseException:  # everything, assertion failures included, goes to the parent
        results.put((name, "error", traceback.format_exc()))


class Processes:
    """Named processes (forked from a warm server: ``process_context``), each running ``fn(name, *args)``;
    their return values by name."""

    def __init__(self) -> None:
        self._ctx = process_context(warm=True)
        self._results = self._ctx.Queue()
        self._procs: dict[str, Any] = {}

    def start(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        proc = self._ctx.Process(target=_child, args=(name, fn, args, self._results, dict(os.environ)), daemon=True)
        proc.start()
        self._procs[name] = proc

    def collect(self, *, timeout_s: float, expect_dead: tuple[str, ...] = ()) -> dict[str, Any]:
        """Every process's value (those named in ``expect_dead`` may die without one).

        Raises:
            DistributedTestError: a process raised or died, or the run took longer than ``timeout_s``.
        """
        values: dict[str, Any] = {}
        deadline = time.monotonic() + timeout_s
        waiting = set(self._procs) - set(expect_dead)
        try:
            while waiting - set(values):
                if time.monotonic() > deadline:
                    raise DistributedTestError(f"timed out after {timeout_s:.0f} s; {sorted(waiting - set(values))} "
                                               "did not finish")
                try:
                    name, status, value = self._results.get(timeout=0.5)
                except queue.Empty:
                    dead = [n for n in waiting - set(values) if self._procs[n].exitcode not in (None, 0)]
                    if dead:
                        raise DistributedTestError(f"{dead[0]} died with exit code {self._procs[dead[0]].exitcode} "
                                                   "and no result") from None
                    continue
                if status == "error":
                    raise DistributedTestError(f"--- {name}:\n{value}")
                values[name] = value
        finally:
            self.close()
        return values

    def close(self) -> None:
        for proc in self._procs.values():
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()


__all__ = ["Processes"]
