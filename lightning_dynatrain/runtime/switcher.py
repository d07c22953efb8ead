"""Layout switches for ``DynaTrainStrategy``: what every switch of a run shares, and one switch.

``LayoutSwitcher`` holds what a run's switches share: the settings parsed once (staging budget,
memory limit, verify), the world's topology and measured link costs (once per world), and the
process groups of every layout and broadcast used so far (switching back costs no group work).
``switch`` runs one hot switch (``megatron.hot_switch``) and returns the new state and the job's
report; with ``verify`` the logical state is fingerprinted on both sides (collective) and a
difference raises ``SwitchVerificationError``. ``prepare`` builds a known next switch's program and
megatron objects in the background (``megatron.ahead``); the switch to that target then binds them.

When a switch runs is the front end's business (``DynaTrainStrategy.reconfigure``: at the
optimizer-step boundary, a request made during a training step deferred to its end); a run's
switches go through ``training_run.TrainingRun``, which checks each target first.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_dynatrain.runtime.reconfig_report import ReconfigReport
from lightning_dynatrain.runtime.step_clock import OverlapClock
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.topology import Topology

if TYPE_CHECKING:
    from lightning_dynatrain.transition.collectives import LinkCosts, SubgroupCache
    from lightning_dynatrain.transition.deadline import SwitchDeadline
    from lightning_dynatrain.transition.watch import SwitchWatch
    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache
    from lightning_dynatrain.megatron.ahead import PendingSwitch, PreparedSwitch
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup
    from lightning_dynatrain.megatron.state import MegatronState
    from megatron.core.optimizer import OptimizerConfig

    from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe
    from lightning_dynatrain.runtime.settings import DynaTrainSettings


@dataclass(frozen=True)
class WorldGroupCaches:
    """One world's caches of groups: megatron's (every layout's) and the switches' broadcast subgroups."""

    groups: "ProcessGroupCache"
    subgroups: "SubgroupCache"


class SwitchVerificationError(RuntimeError):
    """``verify=True`` found the logical state different after a switch (a bug, never a user error)."""

    def __init__(self, message: str, *, hint: str) -> None:
        super().__init__(f"{message}. HINT: {hint}")


class LayoutSwitcher:
    """The switching side of a run (see the module docstring); one per strategy.

    Args:
        staging_budget: bytes of stage buffers a switch may use.
        memory_limit: at most this many bytes a switch may take on one rank; ``None``: no limit.
        verify: fingerprint the full logical state around every switch.
        promote_broadcasts: measure the links once per world and let switches broadcast where that pays.
        switch_timeout: every switch's deadline; ``None``: derived from each switch's bytes and the
            measured links (``transition.deadline``).
        training_timeout: the process groups' timeout outside switches.
        resume_from: says the run's last checkpoint (for ``SwitchFailedError``).
        keep_old: hold the old state until every rank confirmed its new state; a failed switch then
            rolls back to the old layout (``switch_safety="keep_old"``).
        warn: how the switcher warns the user (the front end's rank-zero warning): a switch built
            ahead that could not be used.

    Front ends make theirs from the run's settings (``from_settings``, the one factory). Every switch runs under a ``SwitchWatch`` (``transition.watch``), made at the first switch of each
    world: a rank that dies or stalls makes every survivor raise ``SwitchFailedError``.
    ``DYNATRAIN_SWITCH_FAULT`` (a test hook, ``transition.watch.FaultInjection``) is read here, once.
    """

    def __init__(self, *, staging_budget: int, memory_limit: int | None = None, verify: bool = False,
                 promote_broadcasts: bool = True, switch_timeout: "SwitchDeadline | None" = None,
                 training_timeout: timedelta = timedelta(minutes=30),
                 resume_from: Callable[[], str | None] = lambda: None, keep_old: bool = False,
                 warn: Callable[[str], None] = warnings.warn) -> None:
        from lightning_dynatrain.transition.collectives import SubgroupCache
        from lightning_dynatrain.transition.watch import FaultInjection
        from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache

        self.staging_budget, self.memory_limit, self.verify = staging_budget, memory_limit, verify
        self.promote_broadcasts = promote_broadcasts
        self.switch_timeout, self.training_timeout, self.resume_from = switch_timeout, training_timeout, resume_from
        self.keep_old, self.warn = keep_old, warn
        self.fault = FaultInjection.from_environment()
        self.watch: SwitchWatch | None = None
        self.groups = ProcessGroupCache()
        self.subgroups = SubgroupCache()
        self.topology: Topology | None = None
        self.link_costs: LinkCosts | None = None
        self._setup: SwitchSetup | None = None
        self._prepared: tuple[ParallelConfig, ParallelConfig, PendingSwitch] | None = None
        self.ahead_failures = 0
        """Prepared switches that could not be used (a rank's background build failed); after one,
        this world's switches run on demand."""
        self.clock = OverlapClock()
        """Training steps' seconds, beside a background build or not (``step_ran``)."""

    @classmethod
    def from_settings(cls, settings: "DynaTrainSettings", *, training_timeout: timedelta,
                      resume_from: Callable[[], str | None], warn: Callable[[str], None]) -> "LayoutSwitcher":
        """The switcher of a run with ``settings`` (``DynaTrainSettings``): what every front end makes."""
        return cls(staging_budget=settings.staging_budget, memory_limit=settings.switch_memory_limit,
                   verify=settings.verify, promote_broadcasts=settings.promote_broadcasts,
                   switch_timeout=settings.switch_timeout, training_timeout=training_timeout,
                   resume_from=resume_from, keep_old=settings.switch_safety == "keep_old", warn=warn)

    def new_world(self, topology: Topology) -> None:
        """A world starts (setup): its topology; its link costs are measured at its first switch."""
        self.topology, self.link_costs, self._setup = topology, None, None
        self._drop_prepared()
        self.ahead_failures = 0
        self._close_watch()

    def world_caches(self) -> WorldGroupCaches:
        """This world's group caches (kept with the world for a return to it: ``elastic.world_cache``)."""
        return WorldGroupCaches(self.groups, self.subgroups)

    def new_world_groups(self, groups: "ProcessGroupCache | None" = None,
                         kept: WorldGroupCaches | None = None) -> "ProcessGroupCache":
        """Group caches for a new world (the old world's groups are retired or kept with it):
        ``groups``, the cache the new world's first groups were made into ahead of the change;
        ``kept``, those of a kept world returned to; fresh ones otherwise."""
        from lightning_dynatrain.transition.collectives import SubgroupCache
        from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache

        self.groups = groups or (kept.groups if kept is not None else ProcessGroupCache())
        self.subgroups = kept.subgroups if kept is not None else SubgroupCache()
        self._drop_prepared()  # built on the old world's groups
        self._close_watch()
        return self.groups

    def _close_watch(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def world_watch(self) -> "SwitchWatch":
        """This world's watch (made at its first switch, a world change's grow included, or again
        after a failed one broke its group; collective over the world)."""
        from lightning_dynatrain.transition.collectives import SubgroupCache

        if self.watch is not None and self.watch.broken:  # training went on after a failed switch
            self._close_watch()
            self.subgroups.close()
            self.subgroups = SubgroupCache()
        if self.watch is None:
            self.watch = self.make_watch()
        return self.watch

    def make_watch(self) -> "SwitchWatch":
        """A new watch over the default group now (collective over it): the next world's, made while
        it is borrowed ahead of a grow (``adopt_watch`` installs it at the swap)."""
        from lightning_dynatrain.transition.watch import SwitchWatch

        fault, self.fault = self.fault, None  # the test hook goes to the first watch only
        return SwitchWatch.start(training_timeout=self.training_timeout, timeout=self.switch_timeout,
                                 resume_from=self.resume_from, fault=fault)

    def detach_watch(self) -> None:
        """Forget this world's watch without closing it (its holder closes it: a shrink's, used over
        the old world after the new one is installed)."""
        self.watch = None

    def adopt_watch(self, watch: "SwitchWatch") -> None:
        """``watch`` (``make_watch``, on the world installed since) is this world's from now on."""
        if self.watch is not watch:
            self._close_watch()
            self.watch = watch

    def world_change_setup(self, recipe: "MegatronRecipe", optimizer: "AdamSettings | OptimizerConfig",
                           topology: Topology | None = None, *, grows: bool = False) -> "SwitchSetup":
        """What a world change's switch uses: this world's topology (or ``topology``: the world the
        switch will run over), no broadcasts (their groups would span two worlds). ``keep_old``
        holds for a grow only: its old members hold the whole state, so a failed grow can go back
        to the old world; a shrink cannot (the old world has leavers)."""
        from lightning_dynatrain.megatron.hot_switch import SwitchSetup
        from lightning_dynatrain.runtime.recipe import optimizer_config

        return SwitchSetup(model=recipe.model, seed=recipe.seed, optimizer=optimizer_config(optimizer),
                           staging_budget=self.staging_budget, memory_limit=self.memory_limit,
                           topology=topology or self.topology, keep_old=self.keep_old and grows,
                           execution=recipe.execution)

    def close(self) -> None:
        """Destroy the groups this run made (collective use ends: call at teardown)."""
        self._drop_prepared()  # a background build must not use groups being destroyed
        self._close_watch()
        self.subgroups.close()
        self.groups.close()

    def setup(self, recipe: "MegatronRecipe", optimizer: "AdamSettings | OptimizerConfig",
              group: dist.ProcessGroup | None = None) -> "SwitchSetup":
        """What every switch of this world shares (made at the first switch: it measures the links,
        on ``group``: the watch's, whose timeout bounds the measurement)."""
        if self._setup is None:
            from lightning_dynatrain.transition.collectives import measure_link_costs
            from lightning_dynatrain.megatron.hot_switch import SwitchSetup
            from lightning_dynatrain.runtime.recipe import optimizer_config

            if self.promote_broadcasts and self.link_costs is None:
                self.link_costs = measure_link_costs(group)  # collective; the same on every rank
            self._setup = SwitchSetup(model=recipe.model, seed=recipe.seed, optimizer=optimizer_config(optimizer),
                                      staging_budget=self.staging_budget, memory_limit=self.memory_limit,
                                      topology=self.topology, link_costs=self.link_costs, keep_old=self.keep_old,
                                      execution=recipe.execution)
        return self._setup

    def switch(self, state: "MegatronState", target: ParallelConfig, *, recipe: "MegatronRecipe",
               optimizer: "AdamSettings | OptimizerConfig", step: int,
               deferred: bool) -> tuple["MegatronState", ReconfigReport]:
        """Move every piece of training state from ``state``'s layout to ``target``; collective.

        Raises:
            SwitchFailedError: a rank died or stalled, or a wait ran past the deadline (every survivor).
        """
        from lightning_dynatrain.megatron.hot_switch import hot_switch

        watch = self.world_watch()
        setup = self.setup(recipe, optimizer, group=watch.group)
        prepared = self._take_prepared(state.layout, target, watch.group)
        slowdown = self.clock.slowdown()  # of the steps beside this switch's build (if it had one)
        before = fingerprint(state, setup) if self.verify else None
        result = hot_switch(state, target, setup, groups=self.groups, subgroups=self.subgroups, watch=watch,
                            prepared=prepared)
        if before is not None:
            verify_unchanged(before, result.state, setup)
        return result.state, ReconfigReport.gather(result, step=step, deferred=deferred,
                                                   overlap_slowdown=slowdown if prepared is not None else None)

    def prepare(self, state: "MegatronState", target: ParallelConfig, *, recipe: "MegatronRecipe",
                optimizer: "AdamSettings | OptimizerConfig") -> bool:
        """Start building the switch of ``state`` to ``target`` in the background (``megatron.ahead``);
        the next ``switch`` to ``target`` from this layout uses it, any other drops it. Collective
        (every rank, between the same two steps). Whether a build started (not after a failed one in
        this world, nor for a model that can only be built at the installed layout: switches then
        run on demand)."""
        from lightning_dynatrain.megatron.ahead import prepare_switch

        if self.ahead_failures or target == state.layout or not recipe.model.builds_beside_training:
            return False
        self._drop_prepared()
        watch = self.world_watch()
        setup = self.setup(recipe, optimizer, group=watch.group)
        self._prepared = (state.layout, target, prepare_switch(state, target, setup, groups=self.groups))
        return True

    def _drop_prepared(self) -> None:
        """Forget the build started for another switch, once it ended: two builds at once would
        meet in their all-gather, and a build must not outlive the groups it builds on."""
        if self._prepared is not None:
            self._prepared[2].wait()
            self._prepared = None

    def wait_for_build(self) -> bool:
        """Wait for the background build running, if any (what it built stays); whether none runs now
        (the build ended within the training timeout)."""
        return self._prepared is None or self._prepared[2].wait(self.training_timeout.total_seconds())

    @property
    def building(self) -> bool:
        """A background build runs now."""
        return self._prepared is not None and not self._prepared[2].done

    def step_ran(self, seconds: float, *, beside_build: bool) -> None:
        """A training step took ``seconds`` (``beside_build``: a background build ran as it started)."""
        self.clock.add(seconds, overlapped=beside_build)

    @property
    def prepared_pair(self) -> tuple[ParallelConfig, ParallelConfig] | None:
        """The switch (source, target) a background build was started for (built or not), else ``None``."""
        return self._prepared[:2] if self._prepared is not None else None

    def _take_prepared(self, src: ParallelConfig, target: ParallelConfig,
                       group: dist.ProcessGroup) -> "PreparedSwitch | None":
        """The prepared switch ``src -> target`` when every rank has it built (one small all-reduce
        on ``group``), else ``None`` (the switch builds on demand); a build for another switch is dropped."""
        import torch

        from lightning_dynatrain.transition.comm import default_device
        from lightning_dynatrain.megatron.ahead import PreparedSwitchError

        if self._prepared is None or self._prepared[:2] != (src, target):
            self._drop_prepared()
            return None
        pending, self._prepared = self._prepared, None
        prepared, error = None, None
        try:
            prepared = pending[2].result(timeout=self.training_timeout.total_seconds())
        except PreparedSwitchError as err:
            error = err
        built = torch.tensor([1.0 if prepared is not None else 0.0], device=default_device(group))
        dist.all_reduce(built, op=dist.ReduceOp.MIN, group=group)
        if built.item() == 1.0:
            return prepared
        self.ahead_failures += 1
        self.warn(f"the switch {src} -> {target} was not built ahead on every rank"
                       f"{f' ({error})' if error is not None else ''}: it runs on demand, as will this world's "
                       "next switches")
        return None


def verify_unchanged(before: dict, state: "MegatronState", setup: "SwitchSetup") -> None:
    """Raise ``SwitchVerificationError`` on every rank, naming what differs, when ``state``'s
    fingerprint is not ``before`` (collective)."""
    after = fingerprint(state, setup)
    if after != before:
        from lightning_dynatrain.transition.fingerprint import diff

        raise SwitchVerificationError(
            f"the logical state changed in the switch to {state.layout}: {'; '.join(diff(before, after))}",
            hint="this is a bug in lightning-dynatrain; please report it with the two layouts")


def fingerprint(state: "MegatronState", setup: "SwitchSetup") -> dict:
    """Layout-independent fingerprint of the full logical state (collective): params in their dtype
    (bf16 or fp32), fp32 main params, both Adam moments, every tensor bit for bit
    (``transition.fingerprint``). Adam's step and the param groups are scalars checked by the switch."""
    from lightning_dynatrain.transition.fingerprint import logical_fingerprint
    from lightning_dynatrain.megatron.state_bridge import (
        adam_step,
        materialize_optimizer_state,
        megatron_store,
        precision_of,
    )

    if adam_step(state.optimizer) is None:  # before the first step: zero moments, as hot_switch makes them
        materialize_optimizer_state(state.optimizer, 0)
    rank = dist.get_rank()
    store = megatron_store(state.chunks, state.optimizer, setup.spec, state.layout, rank)
    return logical_fingerprint(store, setup.spec, state.layout, rank, precision_of(state.model, state.optimizer))


__all__ = ["LayoutSwitcher", "SwitchVerificationError", "WorldGroupCaches", "fingerprint", "verify_unchanged"]
