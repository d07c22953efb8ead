"""A hot switch of a megatron GPT's whole training state from one layout to another, in memory.

On every rank, between two optimizer steps:

1. **plan**: this rank's compiled switch program (``transition.compiler.switch_program``: pure, cached
   by its inputs), and its old state as the engine's store of local tensors;
2. **check memory**: every rank's bound on what its switch takes beyond the state
   (``memory_check``), compared per host or device in one small all-gather; a switch that does not
   fit raises ``SwitchMemoryError`` on every rank, with nothing moved;
3. **rebuild**: megatron's groups for the target (kept in ``groups``), the target's model, DDP
   buffers and optimizer, built *without* initialising weights, on those groups, and Adam state
   at the current step, uninitialised (the program writes every element);
4. **execute**: the engine walks the program (``transition.walker``) with the memory policy the
   device's kind chooses once (``devices.device_kind(device).switch_memory``): on accelerators
   plain allocation, on CPU new state written into the old state's memory (the host's
   ``RecyclingMemory``; megatron's DDP buffers built into the old gradient buffers);
5. the new ``MegatronState``, for the caller to install.

A switch refused before anything moved (memory, a budget below a row, state that does not match,
on every rank) restores the old gradient buffers and groups: training can go on at the source.
With ``SwitchSetup(keep_old=True)`` the old state is held until every rank confirmed its new state,
so a switch that fails later rolls back the same way (``devices.memory_policy.KeepOldMemory``).

Example (every rank)::

    setup = SwitchSetup(model=shape, seed=1234, optimizer=adam_config(lr=1e-3), staging_budget=256 * 2**20)
    result = hot_switch(state, ParallelConfig.parse("dp1-tp2-pp2"), setup, groups=ProcessGroupCache())
    state = result.state
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig

from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.transition.collectives import LinkCosts, SubgroupCache
from lightning_dynatrain.transition.comm import group_rank
from lightning_dynatrain.transition.errors import mark_refused, was_refused
from lightning_dynatrain.transition.program import SwitchProgram
from lightning_dynatrain.transition.report import SwitchReport
from lightning_dynatrain.transition.walker import execute_switch
from lightning_dynatrain.transition.switch_attempt import SwitchAttempt
from lightning_dynatrain.transition.watch import SwitchWatch
from lightning_dynatrain.gc_pause import automatic_gc_paused
from lightning_dynatrain.megatron.ahead import PreparedSwitch, process_program
from lightning_dynatrain.megatron.execution import ExecutionOptions
from lightning_dynatrain.megatron.gpt import release_rope_caches
from lightning_dynatrain.megatron.model_source import ModelSource
from lightning_dynatrain.megatron.memory_check import SwitchMemoryError, check_switch_memory, switch_need_bytes
from lightning_dynatrain.megatron.optimizer import adam_config, build_ddp_chunks_and_optimizer, copy_group_settings
from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, initialize_for_layout
from lightning_dynatrain.megatron.state import MegatronState
from lightning_dynatrain.megatron.state_bridge import (
    MegatronTarget,
    adam_step,
    materialize_optimizer_state,
    megatron_store,
    precision_of,
)
from lightning_dynatrain.devices.memory_policy import KeepOldMemory, MemoryFigures, PlainMemory
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.members import Members
from lightning_dynatrain.vps.spec import ModelSpec
from lightning_dynatrain.vps.topology import Topology

if TYPE_CHECKING:
    from lightning_dynatrain.megatron.snapshot import HeldState

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class SwitchSetup:
    """What every hot switch of a run shares: the model, its optimizer, the switch's budgets and the
    world's measured topology and links. Parsed and measured once, where the run starts."""

    model: ModelSource
    """The layout-free model (``ModelProvider`` or ``GPTShape``)."""
    seed: int
    """Megatron's RNG seed (``initialize_for_layout``)."""
    optimizer: OptimizerConfig
    """Megatron's optimizer settings (``build_ddp_and_optimizer``): as the old optimizer's. A mapping
    of ``build_ddp_and_optimizer``'s keyword arguments is read as Adam's (``adam_config``)."""
    staging_budget: int
    """Bytes of stage buffers alive at once."""
    memory_limit: int | None = None
    """At most this many bytes one rank's switch may take beyond its state; ``None``: no limit."""
    check_memory: bool = True
    """Compare every host's (device's) need with its free memory before anything moves."""
    recycle: bool | None = None
    """Write new state into old memory (host memory only; default: on CPU, ``HostKind.switch_memory``)."""
    topology: Topology | None = None
    """The node of every rank (default: nodes of 8 ranks)."""
    link_costs: LinkCosts | None = None
    """The world's measured link speeds: broadcasts are promoted where they pay; ``None``: never."""
    keep_old: bool = False
    """Hold the old state until every rank confirmed its new state (``switch_safety="keep_old"``):
    a switch that fails after moving bytes then rolls back to the old layout (the memory check
    counts the old state held)."""
    execution: ExecutionOptions = ExecutionOptions()
    """Sequence parallelism and activation recompute: the new layout runs as the old one did."""
    spec: ModelSpec = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", self.model.spec())
        if isinstance(self.optimizer, Mapping):
            object.__setattr__(self, "optimizer", adam_config(**self.optimizer))


@dataclass(frozen=True, kw_only=True, slots=True)
class HotSwitchResult:
    """The new state and what the switch cost on this rank."""

    state: MegatronState
    report: SwitchReport
    """The engine's figures (bytes, primitives, its phases)."""
    phases: Mapping[str, float]
    """Seconds of the switch's own phases: ``plan``, ``memory_check``, ``groups``, ``model``,
    ``ddp_optimizer``, ``optimizer_state``, ``engine``; a prepared switch has ``bind`` in place of
    ``model`` and ``ddp_optimizer`` (the engine's share, detailed in ``report``)."""
    seconds: float
    memory: MemoryFigures
    need_bytes: int | None = None
    """The bound on this rank's extra memory the switch was checked against; ``None``: not checked."""
    ahead_build_seconds: float | None = None
    """A prepared switch: its background build's seconds (not in ``seconds``); ``None``: built on demand."""

    @property
    def rebuild_seconds(self) -> float:
        """Building the target's groups, model, DDP buffers, optimizer and Adam state (or, for a
        prepared switch, installing its groups and binding its memory)."""
        return sum(self.phases.get(p, 0.0) for p in ("groups", "model", "ddp_optimizer", "bind", "optimizer_state"))


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
               group: dist.ProcessGroup | None = None, members: Members | None = None,
               watch: SwitchWatch | None = None, prepared: PreparedSwitch | None = None,
               restore_source_groups: bool = True, held: HeldState | None = None) -> HotSwitchResult:
    """Move ``current`` (layout A) to ``target`` (layout B) on this rank; collective over ``group``
    (default the world). Python's automatic garbage collection is paused meanwhile.

    ``groups`` keeps megatron's process groups across layouts (a layout seen before costs no group
    creation), ``subgroups`` the broadcasts' groups. ``members``: which process of ``group`` holds
    each rank of A and B (a world change; default process ``p`` is rank ``p`` of both). The target's
    megatron groups are made on the default group (the new world, installed before).

    ``watch`` (``transition.watch.SwitchWatch``, made once per world): every wait of the switch runs
    under its deadline, on the watch's group (instead of ``group``), and a rank that dies or stalls
    makes every survivor raise ``SwitchFailedError``.

    ``prepared`` (``megatron.ahead.prepare_switch``, or ``prepare_world_switch`` for a world
    change): the program and the target's objects, built ahead for this pair of layouts and
    ``members``; the switch then only binds their memory (no plan, no build). Needs ``groups``, the
    cache the target's groups were made into.

    ``held`` (``megatron.snapshot.HeldState``, a snapshot's own copy): the source instead of
    ``current``, at its own layout (``members`` place its ranks), as a recovery that goes back to a
    snapshot switches; ``current`` only lends its model's settings, its memory freed by the caller
    before it made ``held`` (``state.free_memory``: nothing reads it again, it is not rolled back to).

    A switch that fails with the old state whole (refused, or rolled back under ``keep_old``)
    makes megatron's groups of the source current again from ``groups``; with
    ``restore_source_groups=False`` the caller does (a world change's: they are the old world's).

    Raises:
        PreparedSwitchError: ``prepared`` was made for another switch, or used already.
        SwitchMemoryError: the switch would not fit in memory (or exceed ``setup.memory_limit``).
        StagingBudgetError, StateStoreError, SwitchAbortedError: refused before anything moved.
        In each case on every rank, with the old state whole (``transition.errors.was_refused``).
        SwitchFailedError: (with ``watch``) a rank went missing, or a wait ran past the deadline.
    """
    start, phase = time.perf_counter(), _Phases()
    src, spec = (held or current).layout, setup.spec
    process, members = group_rank(group), members or Members.same(src.world_size, target.world_size)
    precision = precision_of(current.model, current.optimizer)
    with phase("plan"):
        if prepared is not None:
            assert groups is not None, "a prepared switch runs on the groups its target's were made into"
            assert held is None, "a switch from a held state is built on demand"
            prepared.check(src, target, precision, members)
            program = prepared.program
        else:
            program = process_program(setup, src, target, process, precision, members)
        if held is not None:
            assert held.rank == members.src_rank(process), "the held state is another rank's"
            step, source = held.adam_step or 0, held.store
        else:
            step = adam_step(current.optimizer) or 0
            if step == 0:
                materialize_optimizer_state(current.optimizer, 0)
            source = megatron_store(current.chunks, current.optimizer, spec, src, members.src_rank(process))
    device = next(current.model.parameters()).device
    memory = device_kind(device).switch_memory(recycle=setup.recycle, idle_cap=setup.staging_budget,
                                               keep_old=setup.keep_old and held is None)
    old_grads = sum(t.nbytes for t in current.gradient_buffers())
    cached_groups = groups.keys() if groups is not None else frozenset()
    attempt = None
    if watch is not None:  # the watch's group spans ``group`` (or the world) rank for rank: a world change's too
        assert watch.group.size() == (group or dist.GroupMember.WORLD).size(), "the watch is another world's"
        attempt = watch.begin(program, setup.link_costs, f"{src} -> {target}", holders=members.holders)
        group = watch.group
    try:
        if attempt is not None:
            attempt.phase("memory_check")
        with phase("memory_check"):
            need = _check_memory(program, setup, device, f"{src} -> {target}", group, old_grads, memory.held_bytes,
                                 keep_old=setup.keep_old and held is None)
        memory.take_old_buffers(current.gradient_buffers())  # the new buffers take their place (or memory)
        try:
            if attempt is not None:
                attempt.phase("rebuild")
            timeout = attempt.deadline.timedelta if attempt is not None else None
            if prepared is not None:
                new = _bind(current, prepared, setup, step, memory, phase, groups, timeout=timeout)
            else:
                new = _rebuild(current, target, setup, step, memory, phase, groups, timeout=timeout)
            memory.bind(MegatronTarget(new, spec, members.dst_rank(process)))
            with phase("engine"):
                _, report = _execute_watched(program, source, memory, group, attempt, subgroups=subgroups)
            if isinstance(memory, KeepOldMemory):
                memory.commit()  # the old state goes only now
        except BaseException as err:
            if isinstance(memory, KeepOldMemory) and memory.started:  # the old state is whole: back to it
                memory.rollback()
                _back_to(src, setup, groups, cached_groups, restore_source_groups)
            elif not memory.started:  # refused before anything moved: training can go on at ``src``
                memory.restore_old_buffers()
                _back_to(src, setup, groups, cached_groups, restore_source_groups)
                if isinstance(err, DynaTrainError):  # every rank agreed on it (the engine's preflight)
                    mark_refused(err)
            raise
    except Exception as err:
        if attempt is None or was_refused(err):
            raise
        group = None  # the watch drops the switch's group: nothing here may hold it
        traceback.clear_frames(err.__traceback__)
        raise attempt.failure(err, lost_state=memory.started) from err
    finally:
        if watch is not None:
            watch.end()
    release_rope_caches()  # megatron's class-wide cache would keep the old model's rotary tables alive
    return HotSwitchResult(state=new, report=report, phases=dict(phase.seconds), seconds=time.perf_counter() - start,
                           memory=memory.figures(), need_bytes=need,
                           ahead_build_seconds=prepared.build_seconds if prepared is not None else None)


def receive_state(build: Callable[[], MegatronState], model: torch.nn.Module, src: ParallelConfig,
                  target: ParallelConfig, setup: SwitchSetup, *, step: int | Callable[[], int], members: Members,
                  group: dist.ProcessGroup | None = None, ahead: bool = False,
                  watch: Callable[[], SwitchWatch] | None = None) -> HotSwitchResult:
    """A process that joins: its state at ``target`` filled with the others' state at Adam step
    ``step``; the other side of their ``hot_switch`` (or ``send_state``) over ``group``, whose
    process ``members`` says holds no source rank. ``model`` is its shard (weights not needed);
    ``build()`` makes its DDP and optimizer around it, after the memory check as ``hot_switch``
    does (megatron's optimizer runs collectives as it is built: the order must match), or with
    ``ahead`` first, as the others' builds ahead do (``megatron.ahead.prepare_world_switch``).
    ``step`` may be a function, called after the build (the others may still be training).
    ``watch()`` (collective, after ``step``, where the others make theirs before their
    ``hot_switch``): the new world's ``SwitchWatch``; the rest runs under its deadline, on its
    group, and a peer that dies or stalls raises ``SwitchFailedError`` here as on the others."""
    start, phase, process = time.perf_counter(), _Phases(), group_rank(group)
    assert members.src_rank(process) is None, f"process {process} holds a source rank: it switches, not joins"
    device = next(model.parameters()).device
    with phase("plan"):
        program = process_program(setup, src, target, process, precision_of(model, setup.optimizer), members)
    new = None
    if ahead:
        with phase("ddp_optimizer"):
            new = build()
    step = step() if callable(step) else step
    attempt = None
    if watch is not None:
        assert group is None, "a watched switch runs over the world, on the watch's group"
        attempt = watch().begin(program, setup.link_costs, f"joining at {target}", holders=members.holders)
    memory = PlainMemory()

    def fill(group: dist.ProcessGroup | None) -> tuple[MegatronState, int | None, SwitchReport]:
        _phase(attempt, "memory_check")
        with phase("memory_check"):
            need = _check_memory(program, setup, device, f"joining at {target}", group, 0, 0)
        state = new
        if state is None:
            _phase(attempt, "rebuild")
            with phase("ddp_optimizer"):
                state = build()
        with phase("optimizer_state"):
            materialize_optimizer_state(state.optimizer, step, zero=False)
        memory.bind(MegatronTarget(state, setup.spec, members.dst_rank(process)))
        with phase("engine"):
            _, report = _execute_watched(program, {}, memory, group, attempt)
        return state, need, report

    new, need, report = _watched(attempt, group, fill)
    return HotSwitchResult(state=new, report=report, phases=dict(phase.seconds), seconds=time.perf_counter() - start,
                           memory=memory.figures(), need_bytes=need)


def send_state(current: MegatronState, target: ParallelConfig, setup: SwitchSetup, *, members: Members,
               group: dist.ProcessGroup | None = None, watch: SwitchWatch | None = None) -> SwitchReport:
    """A process that leaves: its state goes to the processes that hold ``target`` (the other side
    of their ``hot_switch`` over ``group``); it keeps nothing. ``watch``: ``group``'s switch watch,
    as theirs (a peer that dies or stalls raises ``SwitchFailedError``)."""
    process = group_rank(group)
    assert members.dst_rank(process) is None, f"process {process} holds a target rank: it switches, not leaves"
    src = current.layout
    program = process_program(setup, src, target, process, precision_of(current.model, current.optimizer), members)
    if adam_step(current.optimizer) is None:
        materialize_optimizer_state(current.optimizer, 0)
    source = megatron_store(current.chunks, current.optimizer, setup.spec, src, members.src_rank(process))
    device = next(current.model.parameters()).device
    attempt = watch.begin(program, setup.link_costs, f"leaving {src}", holders=members.holders) \
        if watch is not None else None

    def hand_off(group: dist.ProcessGroup | None) -> SwitchReport:
        _phase(attempt, "memory_check")
        _check_memory(program, setup, device, f"leaving {src}", group, 0, 0)
        return _execute_watched(program, source, PlainMemory(), group, attempt)[1]

    report = _watched(attempt, group, hand_off)
    release_rope_caches()
    return report


def _phase(attempt: SwitchAttempt | None, name: str) -> None:
    if attempt is not None:
        attempt.phase(name)


def _execute_watched(program: SwitchProgram, source: Mapping, memory: PlainMemory, group: dist.ProcessGroup | None,
                     attempt: SwitchAttempt | None, *, subgroups: SubgroupCache | None = None) -> tuple[object, SwitchReport]:
    """``execute_switch`` over ``group``, its phases and waits under ``attempt`` (if any), then every
    rank's confirmation that it holds its new state."""
    result = execute_switch(program, source, memory, group=group, subgroups=subgroups,
                            on_phase=attempt.phase if attempt is not None else None,
                            timeout=attempt.deadline.timedelta if attempt is not None else None)
    if attempt is not None:
        attempt.confirm()
    return result


def _watched(attempt: SwitchAttempt | None, group: dist.ProcessGroup | None,
             body: Callable[[dist.ProcessGroup | None], T]) -> T:
    """``body(group)``; under ``attempt`` (a joiner's or leaver's side of a world change), on its
    watch's group instead, a failure raised as the attempt's ``SwitchFailedError`` (a leaver's
    state counts as lost, ``SwitchAttempt.holds_old_state``; a joiner holds none; a refusal passes
    as it is), and the watch's switch ended. Nothing here holds the watch's group past ``body`` (the watch drops it
    when a switch fails)."""
    if attempt is None:
        return body(group)
    try:
        return body(attempt.watch.group)
    except Exception as err:
        if was_refused(err):
            raise
        traceback.clear_frames(err.__traceback__)
        raise attempt.failure(err, lost_state=attempt.holds_old_state) from err
    finally:
        attempt.watch.end()


def _check_memory(program: SwitchProgram, setup: SwitchSetup, device: torch.device, what: str,
                  group: dist.ProcessGroup | None, old_grads: int, held: int, *, keep_old: bool = False) -> int | None:
    """Every process's bound checked against its free memory and the limit (collective), or nothing."""
    if not (setup.check_memory or setup.memory_limit is not None):
        return None
    need = switch_need_bytes(program, old_grad_bytes=old_grads, held_bytes=held, keep_old=keep_old)
    try:
        check_switch_memory(need, device=device, what=what, limit_bytes=setup.memory_limit, group=group,
                            read_free=setup.check_memory)
    except SwitchMemoryError as err:
        raise mark_refused(err)
    return need


def _back_to(src: ParallelConfig, setup: SwitchSetup, groups: ProcessGroupCache | None, cached: frozenset,
             restore: bool = True) -> None:
    """Megatron's groups of ``src`` again (cached: creates nothing; with ``restore``), after dropping
    the groups the failed switch made for its target (ranks may hold different shares of them)."""
    if groups is not None:
        groups.drop_since(cached)
    if restore:
        initialize_for_layout(src, seed=setup.seed, groups=groups)


def _bind(current: MegatronState, prepared: PreparedSwitch, setup: SwitchSetup, step: int, memory: PlainMemory,
          phase: _Phases, groups: ProcessGroupCache, *, timeout: timedelta | None = None) -> MegatronState:
    """The prepared target's objects, on memory now: its groups installed (cached: made ahead), the
    memory of its params, main params and buffers given back, its Adam state as ``_rebuild``'s."""
    with phase("groups"):
        initialize_for_layout(prepared.target, seed=setup.seed, groups=groups, timeout=timeout)
        torch.manual_seed(setup.seed)  # as an on-demand switch's model build leaves the generator
    new = prepared.state
    with phase("bind"):
        prepared.bind()
        memory.adopt_buffers(prepared.buffers)
        memory.buffers_built()
    with phase("optimizer_state"):
        copy_group_settings(current.optimizer, new.optimizer)
        materialize_optimizer_state(new.optimizer, step, zero=False)
    return new


def _rebuild(current: MegatronState, target: ParallelConfig, setup: SwitchSetup, step: int, memory: PlainMemory,
             phase: _Phases, groups: ProcessGroupCache | None, *, timeout: timedelta | None = None) -> MegatronState:
    """The target's megatron objects, built on the groups made for it (created with ``timeout``), with no weight init."""
    with phase("groups"):
        pgs = initialize_for_layout(target, seed=setup.seed, groups=groups, timeout=timeout)
    with phase("model"):
        model = setup.model.build(target, seed=setup.seed, params_dtype=current.model.config.params_dtype,
                                  initialize=False, pg_collection=pgs, execution=setup.execution,
                                  device=next(current.model.parameters()).device)  # where the old model trains
    with phase("ddp_optimizer"):
        chunks, optimizer = build_ddp_chunks_and_optimizer(model, target, config=setup.optimizer, pg_collection=pgs,
                                                           torch_function_mode=memory.buffer_mode())
        memory.buffers_built()
    with phase("optimizer_state"):
        copy_group_settings(current.optimizer, optimizer)
        materialize_optimizer_state(optimizer, step, zero=False)
    return MegatronState(layout=target, groups=pgs, chunks=chunks, optimizer=optimizer)


__all__ = ["HotSwitchResult", "SwitchSetup", "hot_switch", "receive_state", "send_state"]
