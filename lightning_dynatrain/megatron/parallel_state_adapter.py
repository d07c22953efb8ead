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

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from lightning_dynatrain.compat.megatron_internals import forget_megatron_groups, megatron_groups
from lightning_dynatrain.compat.torch_internals import is_registered
from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.transition.comm import default_device
from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig

#: Megatron's rank order; the same order ``ParallelConfig`` uses for its rank coordinates.
RANK_ORDER = "tp-cp-ep-dp-pp"


class ProcessGroupCache:
    """Process groups kept across layouts, keyed by members and megatron's role for them.

    Creating a group is collective and a gloo/NCCL group's teardown is not free (it is paid when
    the last module holding the groups is collected, wherever that happens). With a
    cache, ``initialize_for_layout`` reuses the groups of any layout seen before and ``destroy``
    leaves cached groups alone, so switching back to a layout costs no group work at all. Every
    rank must use one cache the same way (ranks create groups in the same order, hits included).
    ``close()`` destroys them.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple, object] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group: object) -> bool:
        return any(g is group for g in self._groups.values())

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Inside: ``torch.distributed.new_group`` answers from the cache (megatron calls it)."""
        create = dist.new_group

        def cached(ranks=None, *args, **kwargs):
            key = (tuple(ranks) if ranks is not None else None, kwargs.get("group_desc"), kwargs.get("backend"))
            if key not in self._groups:
                self._groups[key] = create(ranks, *args, **kwargs)
            return self._groups[key]

        dist.new_group = cached
        try:
            yield
        finally:
            dist.new_group = create

    def keys(self) -> frozenset:
        """The groups cached now (``drop_since`` takes it back)."""
        return frozenset(self._groups)

    def drop_since(self, kept: frozenset) -> int:
        """Destroy and forget every group cached after ``keys()`` returned ``kept``; how many.

        After a switch that failed while making the target's groups, ranks may have got different
        shares of them; each rank dropping what it added brings every cache back to the same
        groups, so the next ``initialize_for_layout`` makes the same calls on every rank again.
        """
        new = [key for key in self._groups if key not in kept]
        for key in new:
            _destroy_if_registered(self._groups.pop(key))
        return len(new)

    def close(self) -> None:
        for group in self._groups.values():
            _destroy_if_registered(group)
        self._groups.clear()


def _destroy_if_registered(group: object) -> None:
    if is_registered(group) and group is not dist.GroupMember.WORLD:
        dist.destroy_process_group(group)


def initialize_for_layout(layout: ParallelConfig, *, seed: int, groups: ProcessGroupCache | None = None,
                          timeout: timedelta | None = None) -> ProcessGroupCollection:
    """(Re)build megatron's process groups for ``layout`` on the current WORLD and seed its RNGs.

    Runs ``destroy()`` first if groups exist, then ``initialize_model_parallel`` with the layout's
    tp/pp/vpp/cp/ep/etp sizes (data parallel is what remains) in order ``tp-cp-ep-dp-pp``, then
    ``model_parallel_cuda_manual_seed(seed)``, in the megatron context of the device kind WORLD's
    collectives run on (``transition.comm.default_device``; on CPU the host's megatron patches, with their
    CPU RNG tracker). Collective: every rank of WORLD must call it with the same arguments.
    With ``groups``, groups come from (and stay in) that cache. ``timeout``: the new groups' own
    timeout, their creation's included (default megatron's 30 minutes; a switch passes its deadline).

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
    destroy(keep=groups)
    kind = device_kind(default_device())
    with kind.megatron_context(), (groups.serving() if groups is not None else nullcontext()):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            order=RANK_ORDER,
            # Megatron's extra gloo copies of the DP groups serve only its legacy optimizer
            # checkpoint formats; ``get_megatron_optimizer(pg_collection=...)`` refuses them anyway,
            # and on CPU they would duplicate the real (gloo) groups at every switch.
            create_gloo_process_groups=False,
            **({} if timeout is None else {"distributed_timeout_minutes": timeout.total_seconds() / 60}),
        )
        model_parallel_cuda_manual_seed(seed)
    return current_process_groups()


def prepare_groups(layout: ParallelConfig, *, installed: ParallelConfig, seed: int, groups: ProcessGroupCache,
                   timeout: timedelta | None = None, world: AbstractContextManager | None = None,
                   installed_groups: ProcessGroupCache | None = None) -> ProcessGroupCollection:
    """Make ``layout``'s groups ahead of a switch to it, with ``installed`` left installed: the groups
    go into ``groups`` (the switch then finds them there) and megatron's globals and RNG tracker are
    as before. Collective like ``initialize_for_layout``; the installed layout's groups must come
    from ``groups`` (else they would be destroyed here).

    ``world`` (``elastic.world.BorrowedWorld``): the groups are made on the next world, inside it
    (every member of that world calls this, or its joiners ``initialize_for_layout``); the installed
    layout's groups then come from ``installed_groups``, the running world's cache.

    Megatron makes groups only through its globals, so this runs on the training thread, between
    steps; a layout seen before makes nothing.

    Raises:
        ValueError: a group of the installed layout is not in its cache.
    """
    installed_groups = groups if world is None else installed_groups
    assert installed_groups is not None, "a world change's prepare names the running world's cache"
    world_pg = dist.GroupMember.WORLD
    stray = [g for g in megatron_groups() if g is not world_pg and g not in installed_groups]
    if stray:
        raise ValueError(f"{len(stray)} group(s) of the installed layout {installed} are not in the cache; "
                         "HINT: initialise every layout with the same ProcessGroupCache (groups=...)")
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # initialize_for_layout seeds the tracker (and on CUDA the device's generator) anew
    states = get_cuda_rng_tracker().get_states()
    device_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    if world is None:
        made = initialize_for_layout(layout, seed=seed, groups=groups, timeout=timeout)
    else:
        _forget()  # the running world's groups stay (cached); megatron's globals are made anew inside
        with world:
            made = initialize_for_layout(layout, seed=seed, groups=groups, timeout=timeout)
        _forget()
    initialize_for_layout(installed, seed=seed, groups=installed_groups)  # every group cached: makes nothing
    get_cuda_rng_tracker().set_states(states)
    if device_state is not None:
        torch.cuda.set_rng_state(device_state)
    return made


def _forget() -> None:
    """Megatron's globals dropped, its groups left as they are."""
    parallel_state.destroy_model_parallel()
    forget_megatron_groups()


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


def destroy(keep: ProcessGroupCache | None = None) -> None:
    """Forget megatron's groups and release the ones this rank belongs to.

    ``parallel_state.destroy_model_parallel`` only drops its references (and the gloo side groups);
    the groups themselves stay registered with c10d and keep their sockets. Across many switches
    that leaks file descriptors, so they are destroyed here too (a local call on each rank). Modules built for the old layout must not communicate afterwards. No-op when nothing is
    initialised; WORLD and the groups of ``keep`` are never destroyed.
    """
    groups = megatron_groups()
    parallel_state.destroy_model_parallel()
    forget_megatron_groups()
    world = dist.GroupMember.WORLD
    seen: set[int] = set()
    for group in groups:
        if id(group) in seen or group is world or not is_registered(group) or (keep is not None and group in keep):
            continue
        seen.add(id(group))
        dist.destroy_process_group(group)


__all__ = [
    "ProcessGroupCache",
    "RANK_ORDER",
    "current_process_groups",
    "destroy",
    "initialize_for_layout",
    "is_initialized",
    "prepare_groups",
]
