"""Spawn a fresh job on 127.0.0.1: ``spawn_job(fn, world, *args)`` -> per-rank return values.

Each child is a new interpreter (``torch.multiprocessing`` spawn; the tests' jobs fork theirs
from a warm server instead, ``process_context``): it imports what ``fn`` needs, sets one compute
thread (N ranks share few cores; with ``backend="nccl"`` it takes GPU ``rank % device_count``
instead), joins a process group and runs ``fn(rank, world, *args)``. A child that raises sends its
traceback; one that dies (killed for memory, say) is reported with its exit code. The parent waits
for every child to *exit*, so the next job starts on a machine the old processes have left: that
is what a checkpoint-and-restart baseline pays for. The test suite's ``run_distributed`` is this,
warm, with daemon children and every failing rank's traceback.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any


class JobError(RuntimeError):
    """A rank raised, died without a result, or the job ran out of time; the message holds the tracebacks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What a warm start's server imports once (seconds of CPU each time a fresh interpreter does).
WARM_IMPORTS = ("torch", "torch.distributed", "megatron.core", "lightning.pytorch")
#: The server's environment at its start: one compute thread, as a spawned child sets before it
#: imports torch, so that no BLAS or OpenMP thread exists in the server when it forks.
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def process_context(*, warm: bool) -> Any:
    """The ``multiprocessing`` context children start from. ``warm=False``: ``spawn``, a fresh
    interpreter each (what a restart pays). ``warm=True``: ``forkserver`` with ``WARM_IMPORTS``
    preloaded: one server process imports them once and each child is forked from it, before any
    thread, tensor or process group exists there. A child then holds the server's environment, not
    the parent's of the moment: give it ``os.environ`` and call ``take_environment`` first."""
    import torch.multiprocessing as mp

    if not warm:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(WARM_IMPORTS))
    _start_forkserver()
    return ctx


def _start_forkserver() -> None:
    """Start the server once (a no-op after), under ``_ONE_THREAD``; the parent's environment is as before."""
    from multiprocessing import forkserver

    saved = {name: os.environ.get(name) for name in _ONE_THREAD}
    os.environ.update(_ONE_THREAD)
    try:
        forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def take_environment(environ: dict[str, str]) -> None:
    """In a child: the environment the parent had when it started the child (``process_context``)."""
    os.environ.clear()
    os.environ.update(environ)


class WarmScript:
    """``python SCRIPT ARGS...`` (``module=True``: ``python -m SCRIPT ARGS...``) as a child forked from
    the warm server (``process_context``), with the ``subprocess.Popen`` calls a job's driver uses
    (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``: negative for a signal).
    The child takes ``env`` as its environment and ``cwd`` as its directory, writes its output to
    ``log`` (appended, as the job's other processes do), runs the script as ``__main__`` and the
    interpreter's exit handlers after it, as ``python SCRIPT`` would; it differs from one in what it
    has imported already."""

    def __init__(self, script: Path | str, args: list[str], *, env: dict[str, str], cwd: Path, log: Path,
                 module: bool = False) -> None:
        self._proc = process_context(warm=True).Process(target=_run_script, args=(str(script), args, env, str(cwd),
                                                                                   str(log), module))
        self._proc.start()
        self.pid = self._proc.pid
        self.args = [str(script), *args]

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            try:  # it may end between the check and the signal: nothing to signal then (as Popen's)
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self._proc.kill()


def _run_script(script: str, args: list[str], env: dict[str, str], cwd: str, log: str, module: bool) -> None:
    import atexit
    import runpy
    import sys

    take_environment(env)
    os.chdir(cwd)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    for stream in (sys.stdout, sys.stderr):  # unbuffered, as the job's PYTHONUNBUFFERED asks of an interpreter
        stream.reconfigure(line_buffering=True, write_through=True)
    sys.argv = [script, *args]
    sys.path.insert(0, cwd if module else os.path.dirname(script))
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    finally:  # what an interpreter runs as it exits; a multiprocessing child ends with os._exit, which skips them
        atexit._run_exitfuncs()


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, kwargs: dict, results: Any,
           collective_timeout_s: float, backend: str, stamp_entry: bool, environ: dict[str, str]) -> None:
    entered = time.time()  # the interpreter is up and ``fn``'s module imported (unpickling it does)
    take_environment(environ)
    if backend != "nccl":
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch
        import torch.distributed as dist

        if backend == "nccl":  # one GPU per rank, round robin
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=collective_timeout_s))
        try:
            value = fn(rank, world, *args, **kwargs)
            if stamp_entry and isinstance(value, dict):
                value.setdefault("process_entered_at", entered)
            results.put((rank, "ok", value))
        finally:
            dist.destroy_process_group()
    except BaseException:  # everything, assertion failures included, goes to the parent
        results.put((rank, "error", traceback.format_exc()))


def spawn_job(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 1800.0,
              collective_timeout_s: float = 900.0, backend: str = "gloo", daemon: bool = False,
              error_grace_s: float = 0.0, stamp_entry: bool = True, fn_kwargs: dict | None = None,
              warm: bool = False) -> list[Any]:
    """Run ``fn(rank, world, *args, **fn_kwargs)`` on ``world`` new processes; return the per-rank
    values (picklable) once all have exited.

    Args:
        timeout_s: wall-clock limit of the whole job; the children are killed after it.
        collective_timeout_s: the process group's per-collective timeout in the children.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        daemon: daemon children (they cannot start processes of their own: megatron's checkpoint
            writer does, so a job that saves one needs ``False``).
        error_grace_s: after the first failure, wait this long for other ranks' tracebacks (the
            first to arrive is not always the cause).
        stamp_entry: a rank's ``dict`` result gets ``process_entered_at``, the wall-clock time its
            interpreter was up with ``fn``'s module imported (what a restart's start-up costs).
        warm: fork the children from a server that imported torch, megatron and Lightning once
            (``process_context``) instead of a fresh interpreter each: for tests, never for what a
            restart costs.

    Raises:
        JobError: a rank raised (the tracebacks are in the message), died, or the job timed out.
    """
    ctx = process_context(warm=warm)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, fn_kwargs or {}, results,
                                              collective_timeout_s, backend, stamp_entry, dict(os.environ)),
                         daemon=daemon)
             for r in range(world)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world)) - set(values))
                raise JobError(f"{fn.__name__}: timed out after {timeout_s:.0f}s; ranks {missing} did not finish")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    raise JobError(f"{fn.__name__}: rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                   "and no result (-9: killed, most likely out of memory)") from None
                continue
            if status == "error":
                errors = [(rank, value)] + _more_errors(results, error_grace_s)
                text = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in errors)
                raise JobError(f"{fn.__name__} failed on rank(s) {[r for r, _ in errors]} of {world}:\n{text}")
            values[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30 if len(values) == world else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [values[r] for r in range(world)]


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


__all__ = ["JobError", "WARM_IMPORTS", "WarmScript", "free_port", "process_context", "spawn_job", "take_environment"]
