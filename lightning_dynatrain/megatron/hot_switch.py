"""A hot switch of a megatron GPT's whole training state from one layout to another, in memory.

On every rank, between two optimizer steps:

1. plan this rank's sends, receives and retains (``vps.planner``: pure, no communication), and
   check that every rank's memory can take the switch (``memory_check``: one small all-gather; a
   switch that does not fit raises ``SwitchMemoryError`` on every rank, with nothing moved);
2. re-initialise megatron's process groups for the new layout (``parallel_state_adapter``);
3. build the new layout's model, DDP buffers and optimizer *without* initialising weights, and give
   the optimizer uninitialised Adam state at the current step (``torch.empty``: the plan writes
   every element, vocabulary padding rows only the new layout has included);
4. let the engine move every box from the old model/optimizer tensors into the new ones
   (``engine.execute_switch``): a local tensor retained whole at the same local layout is kept in
   place (the new parameter or Adam state is rebound to the old tensor,
   ``megatron_store_and_adopter``; when that tensor shares its storage with others, the rest of the
   storage is given back as the engine releases it, ``OldStateMemory.kept``),
   other retained boxes are copied locally, the rest exchanged pairwise;
5. drop the old model and optimizer.

Memory: the old gradient buffers are freed before the new model is built (``old_state.py``), and
each old tensor's storage as soon as the engine has read it for the last time, while the new
tensors (allocated untouched) take memory as they are written. On CPU the storages the engine is
done with are not handed back to the OS but carved into the new params and moments that come next
(``engine.recycling``): new state is written into memory the old state already touched, which
saves faulting in (and the kernel zeroing) fresh pages. New DDP buffers go into the old gradient
buffers' memory where they fit; where they do not, they stay untouched until written: the zero1
param buffer by the engine (DDP's copy of the uninitialised params into it is skipped), a gradient
buffer after the engine (``CarveBuffers(skip_copies=True)``). Into those, and into
new tensors no old storage could be carved for, the pages of old storage the engine freed are moved
first (``StorageRecycler.fill``, Linux ``mremap``), so that they too are written in memory already
touched; what the gradient buffers will take is held back for them, and their pages that no old
memory backs are faulted in at the end, not in the first step. A retained piece copied for the
last time from a contiguous old tensor into a contiguous new one at the same offset in a page (a
param into the zero1 param buffer, say) exchanges its whole pages with the new tensor's instead of
being copied (``StorageRecycler.copy_by_pages``). So old and new state overlap only
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
from lightning_dynatrain.engine.recycling import BUFFER_GROUP, CarveBuffers, StorageRecycler, state_group
from lightning_dynatrain.engine.report import SwitchReport
from lightning_dynatrain.engine.staging import parse_bytes
from lightning_dynatrain.gc_pause import automatic_gc_paused
from lightning_dynatrain.megatron.gpt import GPTShape, build_gpt_model, logical_spec
from lightning_dynatrain.megatron.memory_check import check_switch_memory, switch_need_bytes
from lightning_dynatrain.megatron.old_state import OldStateMemory
from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer, copy_group_settings
from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, initialize_for_layout
from lightning_dynatrain.megatron.state_bridge import (
    adam_step,
    materialize_adam_state,
    megatron_store,
    megatron_store_and_adopter,
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
    """Building the new model, DDP buffers and optimizer, and giving (after the engine) the gradient
    buffers left untouched until then their memory."""
    seconds: float
    old_freed_bytes: int
    """Memory of the old state given back during the switch (gradient buffers, then each storage
    the engine was done with); what the new layout kept in place is in ``report.in_place``."""
    recycled_bytes: int = 0
    """New state written into old memory instead of fresh memory (``engine.recycling``): carved out of
    old storages, or backed by their pages moved into it (``StorageRecycler.fill``)."""
    moved_page_bytes: int = 0
    """Of ``recycled_bytes``: old pages moved into new tensors and buffers (``StorageRecycler.fill``)."""
    skipped_copy_bytes: int = 0
    """DDP's copies of the new model's uninitialised params into its zero1 param buffer, skipped
    (``CarveBuffers(skip_copies=True)``): the engine writes that buffer."""
    need_bytes: int | None = None
    """The bound on this rank's extra memory the switch was checked against (``memory_check``);
    ``None`` when it was not checked."""


@automatic_gc_paused()
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
    check_memory: bool = True,
    memory_limit: int | str | None = None,
    recycle: bool | None = None,
) -> HotSwitchResult:
    """Move ``current`` (layout A) to ``target`` (layout B) on this rank; collective over the world.
    Python's automatic garbage collection is paused meanwhile (``lightning_dynatrain.gc_pause``).

    ``optimizer_kwargs`` are ``build_ddp_and_optimizer``'s keyword arguments (lr, weight decay,
    betas, ...): the new optimizer must be configured like the old one. ``groups`` keeps megatron's
    process groups across layouts (``ProcessGroupCache``): none is torn down, a layout seen before
    costs no group creation. ``check_memory`` checks first that the switch fits in every rank's
    memory (``memory_check``), and ``memory_limit`` caps what one rank's switch may take beyond its
    state; either failing raises ``SwitchMemoryError`` on every rank before anything is freed.
    ``recycle`` (default: on CPU) writes new params and moments into old storages the engine is
    done with (``engine.recycling``) instead of fresh memory.
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
    source_regions = rank_regions(spec, src, rank, precision)
    dest_regions = rank_regions(spec, target, rank, precision)
    staging_bytes = parse_bytes(staging_budget)
    old_param = next(current.ddp.module.parameters())
    device = old_param.device
    if recycle is None:
        recycle = device.type == "cpu"  # an accelerator's caching allocator reuses memory by itself
    recycler = StorageRecycler(idle_cap=staging_bytes) if recycle else None
    old_memory = OldStateMemory(current.ddp, source, recycler)
    need = None
    if check_memory or memory_limit is not None:
        need = switch_need_bytes(spec, src, target, rank, precision=precision, gpus_per_node=gpus_per_node,
                                 staging_bytes=staging_bytes, old_grad_bytes=old_memory.gradient_bytes,
                                 recycler_idle_bytes=recycler.idle_cap if recycler is not None else 0,
                                 source_regions=source_regions, dest_regions=dest_regions)
        check_switch_memory(need, device=device, what=f"{src} -> {target}",
                            limit_bytes=None if memory_limit is None else parse_bytes(memory_limit), group=group,
                            read_free=check_memory)
    old_memory.free_gradients()  # before the new buffers are allocated: they take their place (or memory)
    try:
        t0 = time.perf_counter()
        initialize_for_layout(target, seed=seed, groups=groups)
        model = build_gpt_model(shape, target, seed=seed, params_dtype=current.ddp.module.config.params_dtype, initialize=False)
        if device.type != "cpu":  # megatron builds on the CPU here; train where the old model did
            model = model.to(device)
        # DDP's buffers go into the old gradients' memory, not zeroed: megatron's step zeroes the
        # gradient buffer before its first use (``zero_grad_buffer``), the engine writes every param
        # in the zero1 param buffer, and nothing reads the padding between them. DDP's copy of the
        # uninitialised params into that buffer is skipped. A buffer that fits no old gradient
        # storage stays untouched: the engine's writes fault the param buffer's pages in, and a
        # gradient buffer gets its memory after the engine, once the old state's memory is back
        carve = CarveBuffers(recycler, BUFFER_GROUP, zero=False, skip_copies=True) if recycler is not None else None
        ddp, optimizer = build_ddp_and_optimizer(model, target, torch_function_mode=carve, **optimizer_kwargs)
        if recycler is not None:
            recycler.drop_group(BUFFER_GROUP)
            # what old state the engine frees beyond the idle cap is held for the untouched gradient
            # buffers (counted in the memory bound already), and moved into their pages at the end
            recycler.reserve(carve.untouched_bytes)
        copy_group_settings(current.optimizer, optimizer)
        materialize_adam_state(optimizer, step, zero=False)
        dest, rebind = megatron_store_and_adopter(ddp, optimizer, spec, target, rank)
        rebuild = time.perf_counter() - t0

        def adopt(key, tensor):  # kept in place: the old storage stays, minus what nobody keeps
            if not rebind(key, tensor):
                return False
            old_memory.kept(key, tensor)
            return True

        def allocate(key, numel, dtype):  # an old storage the engine is done with, or the new model's own
            tensor = dest[key]
            assert tensor.numel() == numel and tensor.dtype == dtype, (key, tensor.shape, numel, dtype)
            if recycler is not None:
                if rebind.can_rebind(key):
                    carved = recycler.take(key, numel, dtype, state_group(key[1]))
                    if carved is not None and rebind(key, carved):
                        return carved
                recycler.fill(tensor)  # the engine writes all of it: touched pages instead of fresh ones
            return tensor

        _, report = execute_switch(
            plan,
            source,
            source_regions,
            dest_regions,
            allocate,
            adopt=adopt,
            adopt_views=old_memory.gives_pages_back,
            release=old_memory.release,
            staging_budget=staging_budget,
            group=group,
            gpus_per_node=gpus_per_node,
            staging_pages=recycler,
            copy_pages=recycler.copy_by_pages if recycler is not None else None,
        )
        if carve is not None:
            t0 = time.perf_counter()
            carve.fault_in_untouched()
            rebuild += time.perf_counter() - t0
        if recycler is not None:
            recycler.close(rebind)
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
        need_bytes=need,
        recycled_bytes=recycler.reused_bytes + recycler.moved_in_bytes if recycler is not None else 0,
        moved_page_bytes=recycler.moved_in_bytes if recycler is not None else 0,
        skipped_copy_bytes=carve.skipped_copy_bytes if carve is not None else 0,
    )

