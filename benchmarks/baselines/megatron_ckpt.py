"""Baseline: megatron-core's own ``dist_checkpointing``, saved at layout A and loaded at layout B.

The model's ``sharded_state_dict()`` keys carry global layer offsets (the reason it reshards
pipeline stages right), the optimizer's ``sharded_state_dict`` maps Adam's moments onto the same
keys. For the distributed optimizer (zero1) the only resharding format that runs in
megatron-core 0.16.1 on CPU is ``fully_reshardable`` (``fully_sharded_model_space`` fails with
``ShardedTensor.flattened_range is not supported``). That format gathers each DP group's shards on
save and, on load, allocates the whole TP/PP-local optimizer state on every rank before slicing
its shard: its memory need is what ``devices/memory_policy.py`` budgets for it. The save uses megatron's
``distrib_optim_fully_reshardable_mem_efficient`` variant (gather on DP rank 0 only, over the
"gloo" DP group, which on CPU is the DP group itself): the default gathers on every DP rank and
does not fit in memory here for the 270M model at dp4.

Loading a distributed optimizer without Apex or Transformer Engine needs patch G of
``MEGATRON_ON_CPU.md``: the optimizer must already hold Adam state (``build_empty_state`` does
that), and ``_set_main_param_and_optimizer_states`` must skip the ``step`` key that the checkpoint
does not carry (``compat.megatron_internals.optimizer_states_loaded_without_step``, applied only
around the load).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from lightning_dynatrain.compat.megatron_internals import (checkpoint_write_results_queue,
                                                         optimizer_states_loaded_without_step)
from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.megatron.state import MegatronState

#: The distributed optimizer's resharding format (see the module docstring).
SHARDING_TYPE = "fully_reshardable"


@dataclass(frozen=True, slots=True)
class MegatronCkptTimes:
    """Seconds of one side (save or load), slowest rank: building the sharded state dict, I/O, applying."""

    prepare: float
    io: float
    apply: float

    @property
    def total(self) -> float:
        return self.prepare + self.io + self.apply


def _metadata(*, mem_efficient: bool) -> dict:
    return {"distrib_optim_sharding_type": SHARDING_TYPE,
            "distrib_optim_fully_reshardable_mem_efficient": mem_efficient}


def _use_dp_group_as_gloo_group(optimizer) -> None:
    """The memory-efficient gather runs over ``data_parallel_group_gloo``, which our groups do not
    create (``create_gloo_process_groups=False``); on CPU the DP group is a gloo group already."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    for sub in subs:
        if isinstance(sub, DistributedOptimizer) and getattr(sub, "data_parallel_group_gloo", None) is None:
            sub.data_parallel_group_gloo = sub.data_parallel_group


def _sharded_state_dict(state: MegatronState, *, is_loading: bool) -> dict:
    metadata = _metadata(mem_efficient=not is_loading)
    if not is_loading:
        _use_dp_group_as_gloo_group(state.optimizer)
    model = state.model.sharded_state_dict(metadata=metadata)  # model chunks: each under its index
    optimizer = state.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=metadata)
    return {"model": model, "optimizer": optimizer}


def warm_up() -> None:
    """Start the helper process megatron's checkpoint writer keeps for a whole job.

    megatron's ``filesystem_async`` write-results queue spawns a ``multiprocessing.Manager`` (a fresh
    interpreter, about 10 s here) at a process's first save and reuses it afterwards. A training job
    that switches has checkpointed before, so the benchmark pays it outside the timed save.
    """
    checkpoint_write_results_queue()


def _slowest(*seconds: float) -> list[float]:
    import torch

    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _megatron_context(state: MegatronState):
    """Megatron's calls on ``state``'s device (its device kind's context)."""
    return device_kind(next(state.model.parameters()).device).megatron_context()


def save(state: MegatronState, path: str) -> MegatronCkptTimes:
    """Write ``state`` with ``dist_checkpointing.save`` (collective; ``path`` exists, is empty)."""
    dist.barrier()
    t0 = time.perf_counter()
    with _megatron_context(state):
        sharded = _sharded_state_dict(state, is_loading=False)
        t1 = time.perf_counter()
        dist_checkpointing.save(sharded, path)
    dist.barrier()
    t2 = time.perf_counter()
    prepare, io = _slowest(t1 - t0, t2 - t1)
    return MegatronCkptTimes(prepare, io, 0.0)


def load(state: MegatronState, path: str) -> MegatronCkptTimes:
    """Fill ``state`` (built empty at the new layout, Adam state materialised) from ``path``."""
    dist.barrier()
    t0 = time.perf_counter()
    with _megatron_context(state), optimizer_states_loaded_without_step():
        sharded = _sharded_state_dict(state, is_loading=True)
        t1 = time.perf_counter()
        loaded = dist_checkpointing.load(sharded, path)
        t2 = time.perf_counter()
        chunks = [chunk.module for chunk in state.chunks]
        for index, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded["model"][str(index)] if len(chunks) > 1 else loaded["model"])
        state.optimizer.load_state_dict(loaded["optimizer"])
        del loaded, sharded
    dist.barrier()
    t3 = time.perf_counter()
    prepare, io, apply = _slowest(t1 - t0, t2 - t1, t3 - t2)
    return MegatronCkptTimes(prepare, io, apply)


__all__ = ["SHARDING_TYPE", "MegatronCkptTimes", "load", "save", "warm_up"]
