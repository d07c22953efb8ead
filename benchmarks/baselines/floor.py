"""The floor: the least time any switch could take on this machine, from the plans and measured speeds.

    floor = max over ranks of ( (bytes the rank receives from other processes) / (its p2p receive rate)
                              + (bytes the rank keeps) / (its Tensor.copy_ speed) )

i.e. the plan's cross-process bytes at the gloo point-to-point bandwidth plus its retained bytes at
the memcpy speed, per rank, and the slowest rank bounds the switch. Both speeds are measured in the
same run and with every rank busy at once, as in a switch: pairs ``(i, i ^ 1)`` exchange ``nbytes``
both ways with ``isend``/``irecv`` (one rank's receive rate), and every rank copies a ``copy_bytes``
tensor into another, already touched one; best of ``repeats``.

``aggregate_seconds`` is a stricter, unreachable figure kept for reference: *all* ranks' received
bytes over the aggregate rate of all pairs at once, as if a plan could spread its traffic evenly
over every rank (a plan where two ranks receive everything cannot).

``fresh_seconds`` (with ``measure_speeds(fresh=True)``) is the same floor for a switch that writes
its new state into memory the process never touched (a rollout model built for its phase, say):
each receive lands in a buffer allocated just before it, each copy in a new tensor. On a GPU the
caching allocator hands back blocks a process freed, and both floors are alike; where the allocator
gives large blocks back to the kernel (PyTorch's CPU one), every first write of a page takes a fault
and a zeroing (on a virtual machine that reports free pages to its host, on the host too):
``benchmarks/fresh_memory.py`` measures that apart.

Example (every rank)::

    speeds = measure_speeds()
    floor = switch_floor(spec, src, dst, rank, speeds)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.planner import plan_rank
from lightning_dynatrain.vps.spec import ModelSpec, Precision
from lightning_dynatrain.vps.topology import Topology

MiB = 2**20


@dataclass(frozen=True, slots=True)
class Speeds:
    """Measured on this run's ranks, all busy at once."""

    p2p_pair_bytes_per_s: float
    """One rank's receive rate while every pair exchanges both ways at once."""
    p2p_aggregate_bytes_per_s: float
    """Bytes received by all ranks per second (``world`` times the slowest pair's rate)."""
    copy_bytes_per_s: float
    """One rank's ``Tensor.copy_`` rate while every rank copies."""
    p2p_fresh_pair_bytes_per_s: float | None = None
    """``p2p_pair_bytes_per_s`` with each receive into a buffer never touched (``fresh=True``)."""
    copy_fresh_bytes_per_s: float | None = None
    """``copy_bytes_per_s`` with each copy into a tensor never touched (``fresh=True``)."""


@dataclass(frozen=True, slots=True)
class Floor:
    recv_bytes_total: int
    recv_bytes_max: int
    retained_bytes_max: int
    retained_bytes_total: int
    transfer_seconds: float
    """Of the slowest rank (the one that bounds the floor)."""
    copy_seconds: float
    """Of the slowest rank."""
    aggregate_seconds: float
    fresh_seconds: float | None = None
    """The floor with every byte written into untouched memory (``None``: not measured)."""

    @property
    def seconds(self) -> float:
        return self.transfer_seconds + self.copy_seconds

    def as_dict(self) -> dict:
        return {**asdict(self), "seconds": self.seconds}


def _slowest(seconds: float, group: dist.ProcessGroup | None) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _timed(fn, group: dist.ProcessGroup | None) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start, group)


def _best_fresh(write, new, repeats: int, group: dist.ProcessGroup | None) -> float:
    """The best of ``repeats`` timed ``write(new())``, each into a tensor made (not touched) before the clock."""
    times = []
    for _ in range(repeats):
        target = new()
        times.append(_timed(lambda: write(target), group))
        del target
    return min(times)


def measure_speeds(*, nbytes: int = 64 * MiB, copy_bytes: int = 256 * MiB, repeats: int = 3,
                   group: dist.ProcessGroup | None = None, fresh: bool = False) -> Speeds:
    """Pairwise both-ways ``isend``/``irecv`` and concurrent ``copy_``; collective. ``fresh``: the
    same into untouched memory too (``Speeds.p2p_fresh_pair_bytes_per_s``, ``copy_fresh_bytes_per_s``)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    send = torch.ones(nbytes, dtype=torch.uint8)
    peer = rank ^ 1

    def exchange(recv: torch.Tensor) -> None:
        if peer < world:
            works = [dist.isend(send, group_dst=peer, group=group), dist.irecv(recv, group_src=peer, group=group)]
            for work in works:
                work.wait()

    recv = torch.zeros(nbytes, dtype=torch.uint8)
    exchange(recv)  # warm-up: connections are made lazily
    t_p2p = min(_timed(lambda: exchange(recv), group) for _ in range(repeats))
    a = torch.ones(copy_bytes // 4)
    b = torch.zeros_like(a)
    t_copy = min(_timed(lambda: b.copy_(a), group) for _ in range(repeats))
    pair = nbytes / t_p2p
    speeds = Speeds(pair, pair * (world - world % 2), copy_bytes / t_copy)
    if not fresh:
        return speeds
    del recv, b
    t_p2p_fresh = _best_fresh(exchange, lambda: torch.empty(nbytes, dtype=torch.uint8), repeats, group)
    t_copy_fresh = _best_fresh(lambda to: to.copy_(a), lambda: torch.empty_like(a), repeats, group)
    return replace(speeds, p2p_fresh_pair_bytes_per_s=nbytes / t_p2p_fresh,
                   copy_fresh_bytes_per_s=copy_bytes / t_copy_fresh)


def switch_floor(spec: ModelSpec, src: ParallelConfig, dst: ParallelConfig, rank: int, speeds: Speeds, *,
                 precision: Precision = Precision.FP32, topology: Topology | None = None,
                 group: dist.ProcessGroup | None = None, weights_only: bool = False) -> Floor:
    """The floor of ``src -> dst`` from every rank's plan (collective; same result on every rank);
    ``weights_only``: of the weights-only plan (a rollout's switch).

    Uses the uncached ``plan_rank``: a hot switch timed later still pays for its own plan.
    """
    plan = plan_rank(spec, src, dst, rank, precision=precision, topology=topology, weights_only=weights_only)
    mine = torch.tensor([plan.bytes(plan.recvs, spec, precision), plan.bytes(plan.retains, spec, precision)],
                        dtype=torch.int64)
    table = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    recv = [int(t[0]) for t in table]
    kept = [int(t[1]) for t in table]
    per_rank = [(r / speeds.p2p_pair_bytes_per_s, k / speeds.copy_bytes_per_s) for r, k in zip(recv, kept)]
    transfer, copy = max(per_rank, key=sum)
    aggregate = sum(recv) / speeds.p2p_aggregate_bytes_per_s + max(kept) / speeds.copy_bytes_per_s
    fresh = None
    if speeds.p2p_fresh_pair_bytes_per_s is not None and speeds.copy_fresh_bytes_per_s is not None:
        fresh = max(r / speeds.p2p_fresh_pair_bytes_per_s + k / speeds.copy_fresh_bytes_per_s
                    for r, k in zip(recv, kept))
    return Floor(sum(recv), max(recv), max(kept), sum(kept), transfer, copy, aggregate, fresh)


__all__ = ["Floor", "Speeds", "measure_speeds", "switch_floor"]
