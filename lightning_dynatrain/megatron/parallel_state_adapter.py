"""The one module that touches megatron-core's ``parallel_state`` globals.

Megatron 0.16.1 still reads its process groups from module-level globals in places that take no
group argument (the vocab-parallel cross entropy, ``finalize_model_grads`` defaults, the RNG
tracker, ...; see ``EDM_NOTES.md`` section 3). So after every layout switch we re-initialise those
globals for the new layout, on the current default (WORLD) group, and hand the resulting groups to
the modules we build as an explicit ``ProcessGroupCollection``. Nothing else in the project calls
``parallel_state``.

Example, 4 ranks::

    pgs = initialize_for_layout(ParallelConfig.parse("dp2-tp2-pp1"), seed=1234)
    pgs.tp.size(), pgs.dp.size()   # (2, 2); rank 3 has tp rank 1, dp rank 1
    ...
    destroy()                      # before initialize_for_layout(next_layout, ...)
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from lightning_dynatrain.megatron.cpu_patches import megatron_on_cpu
from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig

#: Megatron's rank order; the same order ``ParallelConfig`` uses for its rank coordinates.
RANK_ORDER = "tp-cp-ep-dp-pp"


def initialize_for_layout(layout: ParallelConfig, *, seed: int) -> ProcessGroupCollection:
    """(Re)build megatron's process groups for ``layout`` on the current WORLD and seed its RNGs.

    Runs ``destroy()`` first if groups exist, then ``initialize_model_parallel`` with the layout's
    tp/pp/cp/ep/etp sizes (data parallel is what remains) in order ``tp-cp-ep-dp-pp``, then
    ``model_parallel_cuda_manual_seed(seed)`` (on CPU through the CPU RNG tracker of
    ``cpu_patches``). Collective: every rank of WORLD must call it with the same arguments.

    Returns:
        The groups of this rank as megatron's ``ProcessGroupCollection``, to be passed to modules.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        LayoutError: the layout's world size is not the WORLD size.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised. HINT: call dist.init_process_group(...) "
            "(gloo on CPU, nccl on CUDA) before initialize_for_layout"
        )
    world = dist.get_world_size()
    if layout.world_size != world:
        raise LayoutError(
            f"layout {layout} needs {layout.world_size} ranks (dp*tp*pp*cp) but the world has {world}",
            hint=f"choose sizes whose product dp*tp*pp*cp is {world}",
        )
    destroy()
    with megatron_on_cpu():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            order=RANK_ORDER,
            # Megatron's extra gloo copies of the DP groups serve only its legacy optimizer
            # checkpoint formats; ``get_megatron_optimizer(pg_collection=...)`` refuses them anyway,
            # and on CPU they would duplicate the real (gloo) groups at every switch.
            create_gloo_process_groups=False,
        )
        model_parallel_cuda_manual_seed(seed)
    return current_process_groups()


def current_process_groups() -> ProcessGroupCollection:
    """This rank's megatron groups of the current layout (after ``initialize_for_layout``).

    Raises:
        RuntimeError: no layout is initialised.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron's parallel state is not initialised. HINT: call "
            "initialize_for_layout(layout, seed=...) first"
        )
    return ProcessGroupCollection.use_mpu_process_groups()


def is_initialized() -> bool:
    """True between ``initialize_for_layout`` and ``destroy``."""
    return parallel_state.model_parallel_is_initialized()


def destroy() -> None:
    """Forget megatron's groups and release the ones this rank belongs to.

    ``parallel_state.destroy_model_parallel`` only drops its references (and the gloo side groups);
    the groups themselves stay registered with c10d and keep their sockets. Across many switches
    that leaks file descriptors, so they are destroyed here too (local, about 0.05 ms per group on
    gloo). Modules built for the old layout must not communicate afterwards. No-op when nothing is
    initialised; WORLD is never destroyed.
    """
    groups = [g for g in (parallel_state._global_process_group_list or []) if g is not None]
    parallel_state.destroy_model_parallel()
    parallel_state._global_process_group_list = None
    registered = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    world = dist.GroupMember.WORLD
    seen: set[int] = set()
    for group in groups:
        if id(group) in seen or group is world or group not in registered:
            continue
        seen.add(id(group))
        dist.destroy_process_group(group)


__all__ = [
    "RANK_ORDER",
    "current_process_groups",
    "destroy",
    "initialize_for_layout",
    "is_initialized",
]
