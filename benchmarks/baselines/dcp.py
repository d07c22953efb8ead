"""Baseline: ``torch.distributed.checkpoint`` (DCP) of the *logical* state, resharded on load.

Plain DCP over ``module.state_dict()`` reshards pipeline stages wrong (keys carry stage-local layer
indices). Here every checkpoint key is a logical tensor and state kind (``<tensor>::<kind>``, e.g.
``decoder.layers.mlp.linear_fc1.weight::exp_avg``), one ``ShardedTensor`` of the logical shape
(global layer and expert axes, vocabulary at the padded size) whose shards are the rank's pieces:
its TP/PP/EP boxes, one per local tensor, and its zero1 shards as boxes too. Replicas are written
once (only a piece's primary holder lists it as a local shard). Loading at the new layout lists
*every* piece the rank holds (replicas too) as the shards to fill: DCP intersects them with the
saved chunks and copies straight into megatron's storage (the shards are views of it).

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
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from lightning_dynatrain.engine.pieces import LayoutPieces, Piece, TensorKind, layout_pieces
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec, Precision

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


def fqn(tk: TensorKind) -> str:
    return f"{tk[0]}::{tk[1].value}"


def _placement(rank: int) -> str:
    return f"rank:{rank}/cpu"


def _sharded(pieces: LayoutPieces, tk: TensorKind, local: list[Piece], store: dict, rank: int,
             *, fill_replicas: bool) -> ShardedTensor:
    """A ShardedTensor whose local shards are ``local``'s views and whose global metadata covers
    the tensor with each distinct box once (placed on this rank when it holds it and
    ``fill_replicas``, else on the box's primary holder)."""
    shape = pieces.stored_shape[tk[0]]
    mine = {p.box for p in local}
    shards_md = []
    for box, holders in pieces.holders[tk].items():
        owner = rank if fill_replicas and box in mine else holders[0]
        shards_md.append(ShardMetadata(list(box.lo), list(box.shape), _placement(owner)))
    shards = []
    for p in local:
        view = p.view(store)
        if not view.is_contiguous():
            raise AssertionError(f"{fqn(tk)} piece {p.box}: a non-contiguous view cannot be a ShardedTensor shard")
        shards.append(Shard(view, ShardMetadata(list(p.box.lo), list(p.box.shape), _placement(rank))))
    dtype = shards[0].tensor.dtype if shards else torch.float32
    metadata = ShardedTensorMetadata(shards_md, torch.Size(shape), TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)


def logical_state_dict(store: dict, spec: ModelSpec, layout: ParallelConfig, rank: int, *, for_load: bool,
                       precision: Precision = Precision.FP32) -> dict:
    """``<tensor>::<kind>`` -> ShardedTensor over the rank's pieces (views of ``store``).

    For saving only the pieces this rank is the primary holder of are shards (replicas once);
    for loading every piece it holds is. A ShardedTensor needs at least one global shard, so
    every (tensor, kind) of the layout appears on every rank, possibly with no local shard.
    """
    pieces = layout_pieces(spec, layout, precision)
    mine = pieces.mine(rank, primary_only=not for_load)
    return {fqn(tk): _sharded(pieces, tk, mine.get(tk, []), store, rank, fill_replicas=for_load)
            for tk in pieces.holders}


def _slowest(*seconds: float) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def save(store: dict, spec: ModelSpec, layout: ParallelConfig, rank: int, path: str, *, step: int) -> DcpTimes:
    """Write the rank's state to ``path`` (collective; DCP's ``FileSystemWriter`` fsyncs its files)."""
    dist.barrier()
    t0 = time.perf_counter()
    state = logical_state_dict(store, spec, layout, rank, for_load=False)
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
    state = logical_state_dict(store, spec, layout, rank, for_load=True)
    state[STEP_KEY] = 0
    t1 = time.perf_counter()
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    dist.barrier()
    t2 = time.perf_counter()
    return DcpTimes(*_slowest(t1 - t0, t2 - t1), step=int(state[STEP_KEY]))


__all__ = ["DcpTimes", "STEP_KEY", "fqn", "load", "logical_state_dict", "save"]
