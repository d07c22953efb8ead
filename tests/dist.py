"""Run a test function in N real processes (gloo on 127.0.0.1).

No mocks: each child initialises a real ``torch.distributed`` gloo group, runs the function and
sends back its return value or its traceback text. The parent re-raises the children's
tracebacks, and fails (killing the children it started) when the run exceeds the timeout. The
spawning is the library's (``benchmarks.baselines.launch.spawn_job``), warm: the children are
forked from one server process that imported torch, megatron-core and Lightning once for the
whole session (``process_context``), not fresh interpreters (seconds of CPU each), with the
parent's environment of the moment. Tests that need a fresh interpreter or a real launcher run
``torchrun``, ``fabric run``, ``accelerate launch`` or ``srun`` themselves.

Example::

    def _worker(rank: int, world_size: int, scale: float) -> float:
        t = torch.ones(1) * scale
        dist.all_reduce(t)
        return t.item()

    assert run_distributed(_worker, 2, 1.5) == [3.0, 3.0]

The function must be importable by the children (a module-level function of a test module).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.baselines.launch import JobError, free_port, spawn_job


class DistributedTestError(AssertionError):
    """A child process failed or the run timed out; the message holds the child's traceback."""


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
                    collective_timeout_s: float | None = None, backend: str = "gloo", daemon: bool = True,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks (gloo, or ``backend="nccl"``).

    Args:
        timeout_s: wall-clock limit of the whole run; the children are killed after it.
        collective_timeout_s: gloo's per-collective timeout in the children (default: ``timeout_s``).
            Set it lower to get a child's traceback of where it hung instead of a plain timeout.
        daemon: daemon children, killed with the test process. ``False`` for a job whose ranks
            start processes of their own (megatron's checkpoint writer does).

    Returns:
        The per-rank return values (picklable), indexed by rank.

    Raises:
        DistributedTestError: a child raised (the tracebacks of every rank that failed within a
            few seconds of the first are in the message), died without a result, or the run took
            longer than ``timeout_s``.
    """
    try:
        return spawn_job(fn, world_size, *args, timeout_s=timeout_s,
                         collective_timeout_s=collective_timeout_s or timeout_s, backend=backend, daemon=daemon,
                         error_grace_s=3.0, warm=True, stamp_entry=False, fn_kwargs=kwargs)
    except JobError as err:
        raise DistributedTestError(str(err)) from None


def fabric_executable() -> str:
    """The ``fabric`` executable of this interpreter's environment (Lightning's CLI, a torchrun wrapper)."""
    beside = Path(sys.executable).with_name("fabric")
    found = str(beside) if beside.exists() else shutil.which("fabric")
    assert found, "lightning installs a `fabric` executable; none found beside the interpreter or on PATH"
    return found


__all__ = ["DistributedTestError", "fabric_executable", "free_port", "run_distributed"]

