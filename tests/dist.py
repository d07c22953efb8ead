"""Run a test function in N real processes (``torch.multiprocessing`` spawn, gloo on 127.0.0.1).

No mocks: each child initialises a real ``torch.distributed`` gloo group, runs the function and
sends back its return value or its traceback text. The parent re-raises the first child's
traceback, and fails (killing the children it started) when the run exceeds the timeout.

Example::

    def _worker(rank: int, world_size: int, scale: float) -> float:
        t = torch.ones(1) * scale
        dist.all_reduce(t)
        return t.item()

    assert run_distributed(_worker, 2, 1.5) == [3.0, 3.0]

The function must be importable by the children (a module-level function of a test module).
"""

from __future__ import annotations

import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


class DistributedTestError(AssertionError):
    """A child process failed or the run timed out; the message holds the child's traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, kwargs: dict,
           results: Any, collective_timeout_s: float, backend: str = "gloo") -> None:
    try:
        import torch

        if backend == "nccl":  # one GPU per rank, round robin (the GPU checks)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            torch.set_num_threads(1)  # N ranks share the few cores of a CI machine
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        value = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", value))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
                    collective_timeout_s: float | None = None, backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks (gloo, or ``backend="nccl"``).

    Args:
        timeout_s: wall-clock limit of the whole run; the children are killed after it.
        collective_timeout_s: gloo's per-collective timeout in the children (default: ``timeout_s``).
            Set it lower to get a child's traceback of where it hung instead of a plain timeout.

    Returns:
        The per-rank return values (picklable), indexed by rank.

    Raises:
        DistributedTestError: a child raised (the tracebacks of every rank that failed within a
            few seconds of the first are in the message: the first one to arrive is not always the
            cause), died without a result, or the run took longer than ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    collective_timeout_s = collective_timeout_s or timeout_s
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, port, fn, args, kwargs, results, collective_timeout_s, backend),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise DistributedTestError(f"{fn.__name__}: timed out after {timeout_s:.0f}s; ranks {missing} did not finish")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    raise DistributedTestError(
                        f"{fn.__name__}: rank {dead[0]} died with exit code {procs[dead[0]].exitcode} and no result"
                    ) from None
                continue
            if status == "error":
                errors = [(rank, value)] + _more_errors(results, grace_s=3.0)
                text = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in errors)
                raise DistributedTestError(f"{fn.__name__} failed on rank(s) {[r for r, _ in errors]} of {world_size}:\n{text}")
            values[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [values[r] for r in range(world_size)]


def _more_errors(results: Any, grace_s: float) -> list[tuple[int, str]]:
    """Other ranks' failures that arrive within ``grace_s`` of the first one."""
    errors = []
    end = time.monotonic() + grace_s
    while (left := end - time.monotonic()) > 0:
        try:
            rank, status, value = results.get(timeout=left)
        except queue.Empty:
            break
        if status == "error":
            errors.append((rank, value))
    return errors


__all__ = ["DistributedTestError", "free_port", "run_distributed"]
