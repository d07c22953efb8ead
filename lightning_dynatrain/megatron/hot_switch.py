"""A hot switch of a megatron GPT's whole training state from one layout to another, in memory.

On every rank, between two optimizer steps:

1. plan this rank's sends, receives and retains (``vps.planner``: pure, no communication);
2. re-initialise megatron's process groups for the new layout (``parallel_state_adapter``);
3. build the new layout's model, DDP buffers and optimizer *without* initialising weights, and give
   the optimizer uninitialised Adam state at the current step (``torch.empty``: the plan writes
   every element, vocabulary padding rows only the new layout has included);
4. let the engine move every box from the old model/optimizer tensors into the new ones
   (``engine.execute_switch``): a local tensor retained whole at the same local layout is kept in
   place (the new parameter or Adam state is rebound to the old tensor, ``megatron_adopter``),
   other retained boxes are copied locally, the rest exchanged pairwise;
5. drop the old model and optimizer.

Memory: the old gradient buffers are freed before the new model is built (``old_state.py``), and
each old tensor's storage as soon as the engine has read it for the last time, while the new
tensors (allocated untouched) take memory as they are written. So old and new state overlap only
as far as the plan's order makes them; the engine's staging budget bounds what comes on top. A
switch refused before anything moved (a bad budget, on every rank) leaves the old state whole.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_dynatrain.engine.engine import execute_switch
from lightning_dynatrain.engine.report import SwitchReport
from lightning_dynatrain.megatron.gpt import GPTShape, build_gpt_model, logical_spec
from lightning_dynatrain.megatron.old_state import OldStateMemory
from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer
from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, initialize_for_layout
from lightning_dynatrain.megatron.state_bridge import (
    adam_step,
    materialize_adam_state,
    megatron_adopter,
    megatron_store,
    precision_of,
)
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.planner import plan_rank_cached
from lightning_dynatrain.vps.spec import ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronTrainingState:
    """What a rank trains with at one layout: the DDP-wrapped model and its megatron optimizer."""

    layout: ParallelConfig
    ddp: Any
    optimizer: Any


@dataclass(frozen=True, kw_only=True, slots=True)
class HotSwitchResult:
    """The new state and the figures of the switch (the engine's report plus the rebuild time)."""

    state: MegatronTrainingState
    report: SwitchReport
    rebuild_seconds: float
    seconds: float
    old_freed_bytes: int
    """Memory of the old state given back during the switch (gradient buffers, then each storage
    the engine was done with); what the new layout kept in place is in ``report.in_place``."""


def hot_switch(
    current: MegatronTrainingState,
    target: ParallelConfig,
    *,
    shape: GPTShape,
    seed: int,
    staging_budget: int | str,
    optimizer_kwargs: dict,
    spec: ModelSpec | None = None,
    gpus_per_node: int = 8,
    group: dist.ProcessGroup | None = None,
    groups: ProcessGroupCache | None = None,
) -> HotSwitchResult:
    """Move ``current`` (layout A) to ``target`` (layout B) on this rank; collective over the world.

    ``optimizer_kwargs`` are ``build_ddp_and_optimizer``'s keyword arguments (lr, weight decay,
    betas, ...): the new optimizer must be configured like the old one. ``groups`` keeps megatron's
    process groups across layouts (``ProcessGroupCache``): none is torn down, a layout seen before
    costs no group creation.
    """
    start = time.perf_counter()
    spec = spec or logical_spec(shape)
    rank = dist.get_rank(group)
    src = current.layout
    precision = precision_of(current.ddp.module)
    plan = plan_rank_cached(spec, src, target, rank, precision, gpus_per_node)
    step = adam_step(current.optimizer) or 0
    if step == 0:
        materialize_adam_state(current.optimizer, 0)
    source = megatron_store(current.ddp, current.optimizer, spec, src, rank)
    old_memory = OldStateMemory(current.ddp, source)
    old_memory.free_gradients()  # before the new buffers are allocated: they take their place
    try:
        t0 = time.perf_counter()
        initialize_for_layout(target, seed=seed, groups=groups)
        old_param = next(current.ddp.module.parameters())
        model = build_gpt_model(shape, target, seed=seed, params_dtype=old_param.dtype, initialize=False)
        if old_param.device.type != "cpu":  # megatron builds on the CPU here; train where the old model did
            model = model.to(old_param.device)
        ddp, optimizer = build_ddp_and_optimizer(model, target, **optimizer_kwargs)
        materialize_adam_state(optimizer, step, zero=False)
        dest = megatron_store(ddp, optimizer, spec, target, rank)
        rebuild = time.perf_counter() - t0

        def allocate(key, numel, dtype):  # the new model's own storage: filled in place
            tensor = dest[key]
            assert tensor.numel() == numel and tensor.dtype == dtype, (key, tensor.shape, numel, dtype)
            return tensor

        _, report = execute_switch(
            plan,
            source,
            rank_regions(spec, src, rank, precision),
            rank_regions(spec, target, rank, precision),
            allocate,
            adopt=megatron_adopter(ddp, optimizer, spec, target, rank),
            release=old_memory.release,
            staging_budget=staging_budget,
            group=group,
            gpus_per_node=gpus_per_node,
        )
    except BaseException:
        if not old_memory.started:  # refused before anything moved: training can go on at ``src``
            old_memory.restore_gradients()
            initialize_for_layout(src, seed=seed, groups=groups)
        raise
    return HotSwitchResult(
        state=MegatronTrainingState(layout=target, ddp=ddp, optimizer=optimizer),
        report=report,
        rebuild_seconds=rebuild,
        seconds=time.perf_counter() - start,
        old_freed_bytes=old_memory.freed_bytes,
    )

