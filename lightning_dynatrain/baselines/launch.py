"""Spawn a fresh gloo job on 127.0.0.1: ``spawn_job(fn, world, *args)`` -> per-rank return values.

Each child is a new interpreter (``torch.multiprocessing`` spawn): it imports what ``fn`` needs,
sets one compute thread (N ranks share few cores), joins a gloo group and runs
``fn(rank, world, *args)``. A child that raises sends its traceback; one that dies (killed for
memory, say) is reported with its exit code. The parent waits for every child to *exit*, so the
next job starts on a machine the old processes have left: that is what a checkpoint-and-restart
baseline pays for.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class JobError(RuntimeError):
    """A rank raised, died without a result, or the job ran out of time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, results: Any,
           collective_timeout_s: float) -> None:
    entered = time.time()  # the interpreter is up and ``fn``'s module imported (unpickling it does)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=collective_timeout_s))
        try:
            value = fn(rank, world, *args)
            if isinstance(value, dict):
                value.setdefault("process_entered_at", entered)
            results.put((rank, "ok", value))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def spawn_job(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 1800.0,
              collective_timeout_s: float = 900.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes; return once all have exited.

    The children are not daemons: megatron's checkpoint writer starts a helper process of its own.

    Raises:
        JobError: a rank raised (its traceback is in the message), died, or the job timed out.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, results, collective_timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world:
            if time.monotonic() > deadline:
                raise JobError(f"{fn.__name__}: timed out after {timeout_s:.0f}s")
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    raise JobError(f"{fn.__name__}: rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                   "and no result (-9: killed, most likely out of memory)") from None
                continue
            if status == "error":
                raise JobError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30 if len(values) == world else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [values[r] for r in range(world)]


__all__ = ["JobError", "free_port", "spawn_job"]
