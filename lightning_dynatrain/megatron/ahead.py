"""Ahead-of-time switches: the target's megatron objects built before the switch step, bound to
memory inside it.

An on-demand switch (``hot_switch``) plans and then builds the target's model, DDP buffers and
optimizer inside the pause. For a target known in advance (a scheduled switch) both can happen
earlier, while training steps on:

1. ``prepare_switch`` (training thread, between steps): the target's megatron groups, made into
   the switch's ``ProcessGroupCache`` with the current layout left installed
   (``parallel_state_adapter.prepare_groups``; a layout seen before makes nothing);
2. a background thread then compiles this rank's switch program and builds the target's model,
   DDP and optimizer on those groups, without weight init, and gives their memory back: every
   parameter, fp32 main param and DDP buffer keeps its tensor objects (and megatron's views into
   them) over a storage resized to nothing (``UntypedStorage.resize_(0)``, as FSDP frees
   unsharded parameters). On CPU DDP's buffers are built untouched (the device kind's
   ``unfilled_buffer_mode``: ``CarveBuffers`` over an empty recycler, no page touched, DDP's copies
   of the uninitialised params skipped), so two full copies of the training state never coexist
   there; on a GPU the build holds the target shard's memory until it gives it back;
3. ``hot_switch(..., prepared=...)`` installs the target's groups (cached), gives each released
   storage its size back, hands DDP's buffers to the memory policy (on CPU the old gradient
   buffers' pages go into the new ones) and runs the engine: the pause is the transfer and the
   binding, with no plan and no build.

A build beside training must not call a collective on a group training uses (the two threads'
calls would pair up wrongly): megatron's optimizer all-gathers its param-group keys over the
default group, which in the build runs on a group of its own (``build_collectives``); the tied
embedding's construction-time all-reduce over the embedding group is left out (its result, the
last stage's copy of the embedding, is written by the switch); any other collective fails the
build, and the switch then runs on demand.

A world change (``prepare_world_switch``, from ``elastic/driver/ahead_change.py``) builds the same way
on groups made on the next world before its install; its all-gather runs on the next world's
default group, which training does not use yet (``docs/ahead-of-time.md``).

Example (every rank)::

    pending = prepare_switch(state, ParallelConfig.parse("dp1-tp2-pp2"), setup, groups=cache)
    ...training steps...
    result = hot_switch(state, target, setup, groups=cache, prepared=pending.result())
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.transition.comm import group_rank
from lightning_dynatrain.transition.compiler import switch_program
from lightning_dynatrain.transition.program import SwitchProgram
from lightning_dynatrain.megatron.build_collectives import build_collectives
from lightning_dynatrain.megatron.model_source import build_unfilled
from lightning_dynatrain.megatron.optimizer import build_ddp_chunks_and_optimizer, optimizer_state_views
from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, prepare_groups
from lightning_dynatrain.megatron.state import MegatronState
from lightning_dynatrain.megatron.state_bridge import precision_of
from lightning_dynatrain.thread_end import join_before_exit
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.members import Members
from lightning_dynatrain.vps.planner import default_topology
from lightning_dynatrain.vps.spec import Precision

_log = logging.getLogger(__name__)
#: the builds' own group's timeout: how far apart the ranks' builds may reach megatron's all-gather
ROUTE_TIMEOUT = timedelta(minutes=5)


class PreparedSwitchError(DynaTrainError):
    """A prepared switch that cannot serve this switch (another pair of layouts, bound already, or
    its background build failed)."""


class PreparedSwitch:
    """The target's megatron objects with their memory given back, and this rank's switch program.

    Single use: ``bind`` gives every released storage its size back (fresh memory, contents
    undefined: the switch writes the state, megatron zeroes gradient buffers before their use).
    """

    def __init__(self, *, source: ParallelConfig, target: ParallelConfig, precision: Precision, members: Members,
                 program: SwitchProgram, state: MegatronState, buffers: "_Buffers", released: "_Released",
                 build_seconds: float) -> None:
        self.source, self.target, self.precision, self.members = source, target, precision, members
        self.program, self.state = program, state
        self.buffers = buffers
        """DDP's param and gradient buffers: ``(buffer, the switch writes every element of it)``."""
        self.released = released
        self.build_seconds = build_seconds
        """The background build's seconds (program, model, DDP, optimizer, release)."""
        self._bound = False

    @property
    def released_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.released)

    def check(self, source: ParallelConfig, target: ParallelConfig, precision: Precision, members: Members) -> None:
        """Raise ``PreparedSwitchError`` unless this serves a switch ``source -> target`` at ``precision``
        between ``members``."""
        if self._bound:
            raise PreparedSwitchError(f"the prepared switch {self.source} -> {self.target} was used already",
                                      hint="prepare_switch once per switch")
        if (self.source, self.target, self.precision, self.members) != (source, target, precision, members):
            raise PreparedSwitchError(
                f"a switch {source} -> {target} ({precision.value}, {members}) was given the objects prepared for "
                f"{self.source} -> {self.target} ({self.precision.value}, {self.members})",
                hint="prepare the switch the strategy will run, or switch without prepared=")

    def bind(self) -> None:
        """Give every released storage its size back (inside the switch, after the memory check)."""
        assert not self._bound, "bound already"
        self._bound = True
        for storage, nbytes in self.released:
            storage.resize_(nbytes)

    def __repr__(self) -> str:
        return (f"PreparedSwitch({self.source} -> {self.target}, {len(self.released)} storages, "
                f"{self.released_bytes / 2**20:.1f} MiB released, built in {self.build_seconds:.2f} s)")


class PendingSwitch:
    """A ``PreparedSwitch`` being built in a background thread (``prepare_switch``)."""

    def __init__(self, build, *, background: bool) -> None:
        self._build = build
        self._result: PreparedSwitch | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._abandoned = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="dynatrain-prepare-switch", daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:
            self._result = self._build()
        except BaseException as err:  # reported to whoever asks for the result, and in this rank's log now
            self._error = err
            if self._abandoned:
                _log.info("a build ahead for a switch that will not come ended: %r", err)
                return
            _log.warning("building a switch ahead failed on this rank: %s", "".join(
                traceback.format_exception(type(err), err, err.__traceback__, limit=-4)).rstrip())
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def abandon(self) -> None:
        """The switch will not come (its groups are being destroyed): an error of the build is expected."""
        self._abandoned = True

    def end(self, timeout: float) -> bool:
        """The process closes with this switch not run (``abandon`` first): wait up to ``timeout``
        seconds for the build to end (``thread_end``); whether it did."""
        return join_before_exit(self._thread, timeout=timeout, what="a switch's build ahead")

    @property
    def failed(self) -> bool:
        """The build ended with an error (``result`` raises it)."""
        return self._done.is_set() and self._error is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the build ended (built or failed) within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> PreparedSwitch:
        """The prepared switch (waits for the build).

        Raises:
            PreparedSwitchError: the build failed, or did not end within ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise PreparedSwitchError(f"the switch's objects were not built within {timeout} s",
                                      hint="wait longer, or switch on demand (without prepared=)")
        if self._error is not None:
            raise PreparedSwitchError(f"building the switch's objects ahead failed: {self._error!r}",
                                      hint="switch on demand (without prepared=); see the cause below") \
                from self._error
        assert self._result is not None
        return self._result


def prepare_switch(current: MegatronState, target: ParallelConfig, setup, *, groups: ProcessGroupCache,
                   background: bool = True) -> PendingSwitch:
    """Start preparing the switch of ``current`` to ``target`` (``setup``: the run's ``SwitchSetup``).

    Collective over the world (group creation, then the background build's one all-gather); every
    rank calls it between the same two steps. The target's groups are made here, on the calling
    thread; the rest runs in a background thread (``background=False``: here). Within one world.
    """
    pgs = prepare_groups(target, installed=current.layout, seed=setup.seed, groups=groups)
    with groups.serving():  # once per world: the background build's own group for its all-gather
        route = dist.new_group(ranks=list(range(dist.get_world_size())), group_desc="dynatrain_prepare_switch",
                               timeout=ROUTE_TIMEOUT)
    members = Members.same(current.layout.world_size, target.world_size)
    return _start(current, target, setup, pgs, route, members=members, process=group_rank(None),
                  next_world=False, background=background)


def prepare_world_switch(current: MegatronState, target: ParallelConfig, setup, *, pgs, next_world: dist.ProcessGroup,
                         members: Members, process: int, background: bool = True) -> PendingSwitch:
    """Start preparing a world change's switch of ``current`` to ``target``: ``pgs``, the target's
    groups, were made on the next world (``next_world``, its default group, built and not yet
    installed: ``elastic.world.BorrowedWorld``); ``members`` and ``process`` as the switch will see
    them (``hot_switch(..., members=...)``). The background build's all-gather runs on
    ``next_world`` with the joiners' own builds (``hot_switch.receive_state(ahead=True)``); the
    running world's groups are never touched.
    """
    return _start(current, target, setup, pgs, next_world, members=members, process=process, next_world=True,
                  background=background)


def _start(current: MegatronState, target: ParallelConfig, setup, pgs, route: dist.ProcessGroup, *,
           members: Members, process: int, next_world: bool, background: bool) -> PendingSwitch:
    precision = precision_of(current.model, current.optimizer)
    params_dtype = current.model.config.params_dtype
    device = next(current.model.parameters()).device
    src = current.layout

    def build() -> PreparedSwitch:
        start = time.perf_counter()
        with build_collectives(route, next_world=next_world) as session:
            try:
                program = process_program(setup, src, target, process, precision, members)
                state = build_unfilled_state(setup, target, pgs, params_dtype=params_dtype, device=device)
            except BaseException:
                session.join_missed()  # the other ranks' builds wait in megatron's all-gather for this one
                raise
        buffers, released = _release(state)
        return PreparedSwitch(source=src, target=target, precision=precision, members=members, program=program,
                              state=state, buffers=buffers, released=released,
                              build_seconds=time.perf_counter() - start)

    return PendingSwitch(build, background=background)


def process_program(setup, src: ParallelConfig, target: ParallelConfig, process: int, precision: Precision,
                    members: Members, *, weights_only: bool = False) -> SwitchProgram:
    """This process's compiled program for a switch ``src -> target`` under ``setup`` (a
    ``SwitchSetup``; cached by its inputs); broadcasts only within one world. ``weights_only``: the
    params alone (a rollout's switch)."""
    topology = setup.topology or default_topology(src, target)
    return switch_program(setup.spec, src, target, process, precision, staging_budget=setup.staging_budget,
                          topology=topology, link_costs=setup.link_costs if members.is_identity else None,
                          members=members, weights_only=weights_only)


def build_unfilled_state(setup, target: ParallelConfig, pgs, *, params_dtype: torch.dtype,
                         device: torch.device) -> MegatronState:
    """The target's model, DDP and optimizer on ``pgs``, for a switch to fill: no weight init, no
    construction-time collective but megatron optimizer's all-gather (``model_source.build_unfilled``)."""
    model = build_unfilled(setup.model, target, seed=setup.seed, params_dtype=params_dtype, pg_collection=pgs,
                                 execution=setup.execution, device=device)
    chunks, optimizer = build_ddp_chunks_and_optimizer(model, target, config=setup.optimizer, pg_collection=pgs,
                                                       torch_function_mode=device_kind(device).unfilled_buffer_mode())
    return MegatronState(layout=target, groups=pgs, chunks=chunks, optimizer=optimizer)


_Buffers = tuple[tuple[torch.Tensor, bool], ...]
_Released = tuple[tuple[torch.UntypedStorage, int], ...]


def _release(state: MegatronState) -> tuple[_Buffers, _Released]:
    """Give back the memory of every param, fp32 main param and DDP buffer of ``state`` (storages
    resized to nothing; tensors and views kept). DDP's buffers, and the storages released."""
    buffers = []
    for buf in state.buffers:
        if buf.param_data is not None:
            buffers.append((buf.param_data, True))  # zero1: the engine writes every param into it
        buffers.append((buf.grad_data, False))
    tensors = [b for b, _ in buffers] + [p.data for p in state.model.parameters()]
    tensors += [v.main_param for v in optimizer_state_views(state.chunks, state.optimizer).values()
                if v.main_param is not None]
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages.setdefault(storage.data_ptr(), storage)
    released = tuple((s, s.nbytes()) for s in storages.values())
    for storage, _ in released:
        storage.resize_(0)
    return tuple(buffers), released


__all__ = ["PendingSwitch", "PreparedSwitch", "PreparedSwitchError", "build_unfilled_state", "prepare_switch",
           "prepare_world_switch", "process_program"]
