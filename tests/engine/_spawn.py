"""Spawn N ranks on a chosen backend (``tests/dist.py`` is gloo only): NCCL for the GPU checks.

Each rank takes GPU ``rank % device_count`` before it joins the group. Children send back their
value or their traceback; the parent re-raises the first failure and kills what is left on timeout.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist import DistributedTestError, free_port


def _child(rank: int, world: int, port: int, backend: str, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:  # CPU ranks share the cores: one thread each, or they spin against each other
            torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_backend(fn: Callable[..., Any], world: int, backend: str, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks of ``backend``; per-rank return values."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, backend, fn, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world:
            if time.monotonic() > deadline:
                raise DistributedTestError(f"{fn.__name__} on {backend}: timed out after {timeout_s:.0f}s")
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                continue
            if status == "error":
                raise DistributedTestError(f"{fn.__name__} failed on rank {rank} ({backend}):\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world)]
