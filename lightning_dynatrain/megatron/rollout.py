"""The weights of a rollout phase at another layout, in the same processes (RL's generation phase).

A rollout needs the weights alone: no gradients, no optimizer. ``enter_rollout`` moves them, and
only them, from the training layout to the rollout layout (a weights-only switch: the planner's
``weights_only`` plan, compiled and walked like every switch) into a bare model shard built for
the rollout layout (no DDP, no optimizer, eval mode, no recompute nor sequence parallelism but
where megatron's MoE layers need it), and parks what training needs again only
after the phase (``devices.parked_storage``):

- ``park="in_place"``: the optimizer's state (main params, moments) and the gradient buffers stay
  where they are;
- ``park="host"``: the optimizer's state is copied to host memory and its device memory freed; the
  gradient buffers (nothing in them between two steps) are freed. Where the device's memory is the
  host's (CPU processes, ``DeviceKind.memory_is_host``) nothing moves: there is no other memory;
- ``keep_weights=True``: the training shards of the weights stay, so leaving moves nothing back;
  ``False``: they are freed once the rollout's copy is in place, and ``leave_rollout`` refills
  them with the inverse weights-only switch (the rollout's weights are the training weights, bit
  for bit: nothing updates them in between).

``leave_rollout`` restores what was parked, refills the weights if they went, and makes the
training layout's megatron groups current again (from the run's cache: nothing is created).

Example (every rank, between two optimizer steps)::

    phase = enter_rollout(state, ParallelConfig.parse("dp4-tp1-pp1"), setup, groups=cache, park="host")
    logits = phase.model(input_ids=tokens, position_ids=positions, attention_mask=None)
    leave_rollout(phase, setup, groups=cache)      # the training state as it was, bit for bit
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.devices.memory_policy import KeepOldMemory, PlainMemory
from lightning_dynatrain.devices.parked_storage import ParkedStorages, unique_storages
from lightning_dynatrain.gc_pause import automatic_gc_paused
from lightning_dynatrain.megatron.ahead import process_program
from lightning_dynatrain.megatron.execution import ExecutionOptions
from lightning_dynatrain.megatron.gpt import release_rope_caches
from lightning_dynatrain.megatron.model_source import build_unfilled
from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, initialize_for_layout
from lightning_dynatrain.megatron.state import MegatronState, optimizer_tensors
from lightning_dynatrain.megatron.state_bridge import param_store, precision_of
from lightning_dynatrain.transition.collectives import SubgroupCache
from lightning_dynatrain.transition.comm import group_rank
from lightning_dynatrain.transition.program import StoreKey
from lightning_dynatrain.transition.report import SwitchReport
from lightning_dynatrain.transition.walker import execute_switch
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.members import Members

Park = Literal["in_place", "host"]
PARKS = ("in_place", "host")


class ParamsDestination:
    """A bare model's parameters as a switch's destination: written in place, never rebound."""

    def __init__(self, store: dict[StoreKey, torch.Tensor]) -> None:
        self.store = store

    def tensor(self, key: StoreKey) -> torch.Tensor | None:
        return self.store.get(key)

    def can_rebind(self, key: StoreKey) -> bool:
        return False

    def rebind(self, key: StoreKey, tensor: torch.Tensor) -> bool:
        return False


@dataclass(eq=False, kw_only=True)
class RolloutWeights:
    """One rank's rollout phase: the rollout layout's model and what was parked for it."""

    training: MegatronState
    """The training state, left at its layout (parked as ``park`` and ``keep_weights`` say)."""
    layout: ParallelConfig
    """The rollout layout."""
    groups: ProcessGroupCollection
    """This rank's megatron groups at the rollout layout."""
    model: torch.nn.Module
    """The rollout layout's model shard (eval mode), holding the training weights."""
    park: Park
    keep_weights: bool
    enter_report: SwitchReport
    enter_seconds: float
    parked_bytes: int = 0
    """Device bytes the phase freed: the optimizer's state moved to the host, the gradient buffers,
    and without ``keep_weights`` the training shards of the weights."""
    _parked: list[ParkedStorages] = field(default_factory=list)
    _weights: ParkedStorages | None = None


def enter_rollout(current: MegatronState, target: ParallelConfig, setup, *, groups: ProcessGroupCache,
                  park: Park = "in_place", keep_weights: bool = True, group: dist.ProcessGroup | None = None,
                  subgroups: SubgroupCache | None = None) -> RolloutWeights:
    """Move the weights of ``current`` to a model built for ``target`` and park the rest (see the
    module docstring). Collective over ``group`` (default the world): every rank, the same arguments.
    ``setup`` is the run's ``SwitchSetup``; ``groups`` the run's megatron group cache; ``subgroups``
    its broadcasts' groups (needed where ``setup`` has link costs: broadcasts are promoted)."""
    if park not in PARKS:
        raise ValueError(f"park={park!r}: expected one of {PARKS}")
    start = time.perf_counter()
    src, spec = current.layout, setup.spec
    process = group_rank(group)
    precision = precision_of(current.model, current.optimizer)
    device = next(current.model.parameters()).device
    with automatic_gc_paused():
        program = process_program(setup, src, target, process, precision, Members.same(src.world_size,
                                                                                        target.world_size),
                                  weights_only=True)
        source = param_store(current.model, spec, src, process)
        weight_tensors = list(source.values())
        pgs = initialize_for_layout(target, seed=setup.seed, groups=groups)
        try:
            model = build_unfilled(setup.model, target, seed=setup.seed, params_dtype=current.model.config.params_dtype,
                                   pg_collection=pgs, execution=ExecutionOptions(), device=device)
            model.eval()
            # the training shards are read, never freed by the switch (KeepOldMemory holds what it releases)
            memory = KeepOldMemory(ParamsDestination(param_store(model, spec, target, process)))
            _, report = execute_switch(program, source, memory, group=group, subgroups=subgroups)
        except BaseException:  # nothing of training was touched: its groups current again
            initialize_for_layout(src, seed=setup.seed, groups=groups)
            raise
    phase = RolloutWeights(training=current, layout=target, groups=pgs, model=model, park=park,
                           keep_weights=keep_weights, enter_report=report, enter_seconds=0.0)
    kind = device_kind(device)
    if park == "host" and not kind.memory_is_host:
        phase._parked.append(ParkedStorages.to_host(
            unique_storages(optimizer_tensors(current), leaving_out=weight_tensors), kind.host_copier()))
        phase._parked.append(ParkedStorages.drop(unique_storages(current.gradient_buffers(),
                                                                 leaving_out=weight_tensors)))
    if not keep_weights:
        phase._weights = ParkedStorages.drop(unique_storages(weight_tensors))
    phase.parked_bytes = sum(p.bytes for p in phase._parked) + (phase._weights.bytes if phase._weights else 0)
    phase.enter_seconds = time.perf_counter() - start
    return phase


def leave_rollout(phase: RolloutWeights, setup, *, groups: ProcessGroupCache, group: dist.ProcessGroup | None = None,
                  subgroups: SubgroupCache | None = None) -> SwitchReport | None:
    """Back to training: what was parked restored, the weights refilled from the rollout's copy
    without ``keep_weights`` (the inverse weights-only switch: its report; ``None`` when nothing
    moved), the training layout's groups current again. Collective, as ``enter_rollout``."""
    training, spec = phase.training, setup.spec
    process = group_rank(group)
    report = None
    for parked in phase._parked:
        parked.restore()
    phase._parked.clear()
    try:
        with automatic_gc_paused():
            if phase._weights is not None:
                phase._weights.restore()  # zeroed: the inverse switch writes every element of a param
                phase._weights = None
                precision = precision_of(training.model, training.optimizer)
                program = process_program(setup, phase.layout, training.layout, process, precision,
                                          Members.same(phase.layout.world_size, training.layout.world_size),
                                          weights_only=True)
                source = param_store(phase.model, spec, phase.layout, process)
                memory = PlainMemory(ParamsDestination(param_store(training.model, spec, training.layout, process)))
                _, report = execute_switch(program, source, memory, group=group, subgroups=subgroups)
            initialize_for_layout(training.layout, seed=setup.seed, groups=groups)
    finally:  # the rollout's model goes with the phase (also when the refill failed: a member died)
        phase.model = None
        release_rope_caches()
    return report


__all__ = ["PARKS", "Park", "ParamsDestination", "RolloutWeights", "enter_rollout", "leave_rollout"]
