"""Intra-op threads per process: fit torch's thread pool to the cores a node's processes share.

Why: every rank of a CPU job runs torch's intra-op thread pool. When a node's processes together
run more threads than it has cores, threads wait for each other at every parallel region and a
step takes many times longer: ``fabric run --devices 4`` on 2 cores left 2 threads in each of the 4
processes and its 10 demo steps took 59.6 s, against 4.5 s with 1 thread each. The launchers
disagree on the count: Lightning's own launcher gives ``cores // processes``, torchrun sets
``OMP_NUM_THREADS=1``, ``fabric run`` sets ``OMP_NUM_THREADS`` to *all* the cores (not per
process), and ``srun`` sets nothing (torch then takes every core).

The rule (``decide_threads``), applied by ``DynaTrainStrategy.setup_environment`` on every rank:

- ``DYNATRAIN_NUM_THREADS=N`` in the environment is the user's explicit choice: every process
  runs ``N`` threads, whatever the cores, and nothing is said.
- Otherwise, when ``threads x local processes`` exceeds the cores, the threads drop to
  ``max(1, cores // local processes)`` and rank 0 says so once (a later fit in the same process
  finds the count already lowered and says nothing).
- ``OMP_NUM_THREADS`` alone is *not* an explicit choice: ``fabric run`` sets it by itself, so a
  rule that respected it would never fire where it is needed. A user who wants more threads than
  cores per process sets ``DYNATRAIN_NUM_THREADS``.

A thread count set with ``torch.set_num_threads`` in the script is not told apart from the
launcher's and is lowered too when it oversubscribes the cores.

Example (4 processes on 2 cores under ``fabric run``)::

    >>> decide_threads(current=2, local_processes=4, cores=2, explicit=None).threads
    1
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lightning_dynatrain.vps.errors import DynaTrainError

ENV = "DYNATRAIN_NUM_THREADS"


class ThreadCountError(DynaTrainError):
    """``DYNATRAIN_NUM_THREADS`` is not a positive whole number."""


@dataclass(frozen=True, slots=True)
class ThreadDecision:
    """How many intra-op threads each process runs, and why.

    Attributes:
        threads: the count after the decision.
        before: the count torch had before it.
        reason: ``"explicit"`` (``DYNATRAIN_NUM_THREADS``), ``"fits"`` (nothing to do) or ``"lowered"``.
        message: what rank 0 says, or ``None`` when there is nothing to say.
    """

    threads: int
    before: int
    reason: str
    message: str | None = None


def decide_threads(*, current: int, local_processes: int, cores: int, explicit: str | None) -> ThreadDecision:
    """The intra-op thread count for one of ``local_processes`` processes on ``cores`` cores (pure).

    Raises:
        ThreadCountError: ``explicit`` (the value of ``DYNATRAIN_NUM_THREADS``) is not a positive integer.
    """
    if explicit is not None and explicit.strip():
        try:
            threads = int(explicit)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ThreadCountError(f"{ENV}={explicit!r} is not a positive whole number of threads",
                                   hint=f"set {ENV} to e.g. 1, or unset it to fit the threads to the cores")
        return ThreadDecision(threads=threads, before=current, reason="explicit")
    processes = max(1, local_processes)
    if current * processes <= cores:
        return ThreadDecision(threads=current, before=current, reason="fits")
    target = max(1, cores // processes)
    if target >= current:  # already as low as it goes (e.g. 1 thread, more processes than cores)
        return ThreadDecision(threads=current, before=current, reason="fits")
    omp = os.environ.get("OMP_NUM_THREADS")
    was = f"OMP_NUM_THREADS={omp}" if omp else "torch's default"
    message = (f"[dynatrain] {processes} processes x {current} intra-op threads exceed the {cores} cores of this "
               f"node: using {target} thread{'s' if target > 1 else ''} per process (was {current}, {was}); "
               f"set {ENV}=N to choose the count yourself")
    return ThreadDecision(threads=target, before=current, reason="lowered", message=message)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, as a job scheduler sets it), else all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fit_intra_op_threads(local_processes: int) -> ThreadDecision:
    """Apply ``decide_threads`` to this process: ``torch.set_num_threads`` and ``OMP_NUM_THREADS``.

    ``OMP_NUM_THREADS`` is set too, so that processes started later from this one (data loader
    workers, a launcher's children) start with the same count.
    """
    decision = decide_threads(current=torch.get_num_threads(), local_processes=local_processes,
                              cores=available_cores(), explicit=os.environ.get(ENV))
    if decision.threads != decision.before:
        torch.set_num_threads(decision.threads)
    if decision.reason != "fits" or "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(decision.threads)
    return decision


__all__ = ["ENV", "ThreadCountError", "ThreadDecision", "available_cores", "decide_threads", "fit_intra_op_threads"]
