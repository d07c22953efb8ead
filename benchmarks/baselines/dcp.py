"""Baseline: ``torch.distributed.checkpoint`` (DCP) of the *logical* state, resharded on load.

The state dict is the package's layout-free checkpoint format (``lightning_dynatrain.checkpoint.logical``):
every checkpoint key a logical tensor and state kind, one ``ShardedTensor`` of the logical shape
whose shards are the rank's pieces (replicas written once), loaded at the new layout straight into
megatron's storage. Here it is timed (building the state dict, then ``dcp.save``/``dcp.load``), with
Adam's step as one scalar beside it.

Example (every rank)::

    times = save(store_a, spec, layout_a, rank, "/tmp/ckpt", step=1)
    state_b = build_empty_state(setup, layout_b, step=0)
    step = load(store_of(state_b, spec, rank), spec, layout_b, rank, "/tmp/ckpt").step
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_dynatrain.checkpoint.logical import fqn, logical_load_state_dict, logical_state_dict, saved_shapes
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec

STEP_KEY = "optimizer.step"


@dataclass(frozen=True, slots=True)
class DcpTimes:
    """Seconds, slowest rank: building the sharded state dict, then ``dcp.save``/``dcp.load``."""

    prepare: float
    io: float
    step: int = 0

    @property
    def total(self) -> float:
        return self.prepare + self.io


def _slowest(*seconds: float) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def save(store: dict, spec: ModelSpec, layout: ParallelConfig, rank: int, path: str, *, step: int) -> DcpTimes:
    """Write the rank's state to ``path`` (collective; DCP's ``FileSystemWriter`` fsyncs its files)."""
    dist.barrier()
    t0 = time.perf_counter()
    state = logical_state_dict(store, spec, layout, rank)
    state[STEP_KEY] = step
    t1 = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))
    dist.barrier()
    t2 = time.perf_counter()
    return DcpTimes(*_slowest(t1 - t0, t2 - t1), step=step)


def load(store: dict, spec: ModelSpec, layout: ParallelConfig, rank: int, path: str) -> DcpTimes:
    """Fill ``store`` (the new layout's live tensors) from ``path``; returns the saved Adam step."""
    dist.barrier()
    t0 = time.perf_counter()
    state = logical_load_state_dict(store, spec, layout, rank, saved=saved_shapes(path))
    state[STEP_KEY] = 0
    t1 = time.perf_counter()
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    dist.barrier()
    t2 = time.perf_counter()
    return DcpTimes(*_slowest(t1 - t0, t2 - t1), step=int(state[STEP_KEY]))


__all__ = ["DcpTimes", "STEP_KEY", "fqn", "load", "save"]
