"""A hot switch of a megatron GPT's whole training state from one layout to another, in memory.

On every rank, between two optimizer steps:

1. **plan**: this rank's compiled switch program (``engine.compiler.switch_program``: pure, cached
   by its inputs), and its old state as the engine's store of local tensors;
2. **check memory**: every rank's bound on what its switch takes beyond the state
   (``memory_check``), compared per host or device in one small all-gather; a switch that does not
   fit raises ``SwitchMemoryError`` on every rank, with nothing moved;
3. **rebuild**: megatron's groups for the target (kept in ``groups``), the target's model, DDP
   buffers and optimizer, built *without* initialising weights, on those groups, and Adam state
   at the current step, uninitialised (the program writes every element);
4. **execute**: the engine walks the program (``engine.walker``) with the memory policy chosen
   once from the device (``memory.switch_memory``): on accelerators plain allocation, on CPU new
   state written into the old state's memory (``memory.RecyclingMemory``; megatron's DDP buffers
   built into the old gradient buffers, ``carve_buffers``);
5. the new ``MegatronState``, for the caller to install.

A switch refused before anything moved (memory, a budget below a row, state that does not match,
on every rank) restores the old gradient buffers and groups: training can go on at the source.

Example (every rank)::

    setup = SwitchSetup(shape=shape, seed=1234, optimizer=dict(lr=1e-3), staging_budget=256 * 2**20)
    result = hot_switch(state, ParallelConfig.parse("dp1-tp2-pp2"), setup, groups=ProcessGroupCache())
    state = result.state
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType

import torch.distributed as dist

from lightning_dynatrain.engine.collectives import LinkCosts, SubgroupCache
from lightning_dynatrain.engine.compiler import switch_program
from lightning_dynatrain.engine.errors import mark_refused
from lightning_dynatrain.engine.report import SwitchReport
from lightning_dynatrain.engine.walker import execute_switch
from lightning_dynatrain.gc_pause import automatic_gc_paused
from lightning_dynatrain.megatron.carve_buffers import switch_buffers
from lightning_dynatrain.megatron.gpt import GPTShape, build_gpt_model, logical_spec
from lightning_dynatrain.megatron.memory_check import SwitchMemoryError, check_switch_memory, switch_need_bytes
from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer, copy_group_settings
from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, initialize_for_layout
from lightning_dynatrain.megatron.state import MegatronState
from lightning_dynatrain.megatron.state_bridge import (
    MegatronTarget,
    adam_step,
    materialize_adam_state,
    megatron_store,
    precision_of,
)
from lightning_dynatrain.memory.policy import MemoryFigures, PlainMemory, switch_memory
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.planner import default_topology
from lightning_dynatrain.vps.spec import ModelSpec
from lightning_dynatrain.vps.topology import Topology


@dataclass(frozen=True, kw_only=True, slots=True)
class SwitchSetup:
    """What every hot switch of a run shares: the model, its optimizer, the switch's budgets and the
    world's measured topology and links. Parsed and measured once, where the run starts."""

    shape: GPTShape
    """The layout-free model."""
    seed: int
    """Megatron's RNG seed (``initialize_for_layout``)."""
    optimizer: Mapping[str, object]
    """``build_ddp_and_optimizer``'s settings (lr, weight decay, betas, ...): as the old optimizer's."""
    staging_budget: int
    """Bytes of stage buffers alive at once."""
    memory_limit: int | None = None
    """At most this many bytes one rank's switch may take beyond its state; ``None``: no limit."""
    check_memory: bool = True
    """Compare every host's (device's) need with its free memory before anything moves."""
    recycle: bool | None = None
    """Write new state into old memory (default: on CPU, ``memory.switch_memory``)."""
    topology: Topology | None = None
    """The node of every rank (default: nodes of 8 ranks)."""
    link_costs: LinkCosts | None = None
    """The world's measured link speeds: broadcasts are promoted where they pay; ``None``: never."""
    spec: ModelSpec = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", logical_spec(self.shape))
        object.__setattr__(self, "optimizer", MappingProxyType(dict(self.optimizer)))


@dataclass(frozen=True, kw_only=True, slots=True)
class HotSwitchResult:
    """The new state and what the switch cost on this rank."""

    state: MegatronState
    report: SwitchReport
    """The engine's figures (bytes, primitives, its phases)."""
    phases: Mapping[str, float]
    """Seconds of the switch's own phases: ``plan``, ``memory_check``, ``groups``, ``model``,
    ``ddp_optimizer``, ``optimizer_state``, ``engine`` (the engine's share, detailed in ``report``)."""
    seconds: float
    memory: MemoryFigures
    need_bytes: int | None = None
    """The bound on this rank's extra memory the switch was checked against; ``None``: not checked."""

    @property
    def rebuild_seconds(self) -> float:
        """Building the target's groups, model, DDP buffers, optimizer and Adam state."""
        return sum(self.phases.get(p, 0.0) for p in ("groups", "model", "ddp_optimizer", "optimizer_state"))


class _Phases:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@automatic_gc_paused()
def hot_switch(current: MegatronState, target: ParallelConfig, setup: SwitchSetup, *,
               groups: ProcessGroupCache | None = None, subgroups: SubgroupCache | None = None,
               group: dist.ProcessGroup | None = None) -> HotSwitchResult:
    """Move ``current`` (layout A) to ``target`` (layout B) on this rank; collective over ``group``
    (default the world). Python's automatic garbage collection is paused meanwhile.

    ``groups`` keeps megatron's process groups across layouts (a layout seen before costs no group
    creation), ``subgroups`` the broadcasts' groups.

    Raises:
        SwitchMemoryError: the switch would not fit in memory (or exceed ``setup.memory_limit``).
        StagingBudgetError, StateStoreError, SwitchAbortedError: refused before anything moved.
        In each case on every rank, with the old state whole (``engine.errors.was_refused``).
    """
    start, phase = time.perf_counter(), _Phases()
    rank = dist.get_rank(group)
    src, spec = current.layout, setup.spec
    with phase("plan"):
        topology = setup.topology or default_topology(src, target)
        program = switch_program(spec, src, target, rank, precision_of(current.model),
                                 staging_budget=setup.staging_budget, topology=topology, link_costs=setup.link_costs)
        step = adam_step(current.optimizer) or 0
        if step == 0:
            materialize_adam_state(current.optimizer, 0)
        source = megatron_store(current.ddp, current.optimizer, spec, src, rank)
    device = next(current.model.parameters()).device
    memory = switch_memory(device, recycle=setup.recycle, idle_cap=setup.staging_budget, buffer_mode=switch_buffers)
    need = None
    with phase("memory_check"):
        if setup.check_memory or setup.memory_limit is not None:
            old_grads = sum(t.nbytes for t in current.gradient_buffers())
            need = switch_need_bytes(program, old_grad_bytes=old_grads, held_bytes=memory.held_bytes)
            try:
                check_switch_memory(need, device=device, what=f"{src} -> {target}", limit_bytes=setup.memory_limit,
                                    group=group, read_free=setup.check_memory)
            except SwitchMemoryError as err:
                raise mark_refused(err)
    memory.take_old_buffers(current.gradient_buffers())  # the new buffers take their place (or memory)
    try:
        new = _rebuild(current, target, setup, step, memory, phase, groups)
        memory.bind(MegatronTarget(new, spec, rank))
        with phase("engine"):
            _, report = execute_switch(program, source, memory, group=group, subgroups=subgroups)
    except BaseException as err:
        if not memory.started:  # refused before anything moved: training can go on at ``src``
            memory.restore_old_buffers()
            initialize_for_layout(src, seed=setup.seed, groups=groups)
            if isinstance(err, DynaTrainError):  # every rank agreed on it (the engine's preflight)
                mark_refused(err)
        raise
    return HotSwitchResult(state=new, report=report, phases=dict(phase.seconds), seconds=time.perf_counter() - start,
                           memory=memory.figures(), need_bytes=need)


def _rebuild(current: MegatronState, target: ParallelConfig, setup: SwitchSetup, step: int, memory: PlainMemory,
             phase: _Phases, groups: ProcessGroupCache | None) -> MegatronState:
    """The target's megatron objects, built on the groups made for it, with no weight init."""
    with phase("groups"):
        pgs = initialize_for_layout(target, seed=setup.seed, groups=groups)
    with phase("model"):
        model = build_gpt_model(setup.shape, target, seed=setup.seed, params_dtype=current.model.config.params_dtype,
                                initialize=False, pg_collection=pgs)
        device = next(current.model.parameters()).device
        if device.type != "cpu":  # megatron builds on the CPU here; train where the old model did
            model = model.to(device)
    with phase("ddp_optimizer"):
        ddp, optimizer = build_ddp_and_optimizer(model, target, pg_collection=pgs, torch_function_mode=memory.buffer_mode(),
                                                 **setup.optimizer)
        memory.buffers_built()
    with phase("optimizer_state"):
        copy_group_settings(current.optimizer, optimizer)
        materialize_adam_state(optimizer, step, zero=False)
    return MegatronState(layout=target, groups=pgs, ddp=ddp, optimizer=optimizer)


__all__ = ["HotSwitchResult", "SwitchSetup", "hot_switch"]
