"""A world change built ahead: the next world's megatron groups, its topology and the target's megatron
objects made while the running world trains, so that the change's pause is the transfer.

A change then takes two step boundaries (``ElasticDriver.at_boundary``):

1. **prepare**, at the first boundary where every member voted the next world built: on the training
   thread, with the next world's group borrowed (``elastic.world.BorrowedWorld``), its members run
   what its joiners run on entering it: the header broadcast (a grow; the driver sends it), megatron's
   groups for the target (into a fresh cache) and the topology all-gather. The running world is the
   default group again before the next step. A background thread then compiles this process's
   program and builds the target's model, DDP and optimizer on the new groups
   (``megatron.ahead.prepare_world_switch``), with its one all-gather on the next world, where the
   joiners' own builds meet it (they build in their set-up, before the state comes:
   ``hot_switch.receive_state(ahead=True)``);
2. **swap**, at the first later boundary where every member of the running world has its build
   (``built_everywhere``: one small all-reduce a boundary meanwhile): the world is installed and the
   switch binds the prepared objects (no groups, plan or build in the pause).

A leaver builds nothing (it votes yes at once). Between the two boundaries a layout switch within
the running world is refused (``WorldChangePendingError``, before anything moves): the build is
from the current layout. A change cancelled meanwhile (a joiner died) drops
its build (``drop``). A build that fails on any member stops the change on every member with
``AheadBuildError``: ``OnNodeChange(ahead=False)`` builds in the pause instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_dynatrain.thread_end import BUILD_END_WAIT
from lightning_dynatrain.vps.errors import DynaTrainError

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.driver.layout_policy import LayoutChoice
    from lightning_dynatrain.elastic.session import WorldChange
    from lightning_dynatrain.elastic.world import BorrowedWorld
    from lightning_dynatrain.transition.watch import SwitchWatch
    from lightning_dynatrain.megatron.ahead import PendingSwitch, PreparedSwitch
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup
    from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache
    from lightning_dynatrain.runtime.switcher import WorldGroupCaches
    from lightning_dynatrain.runtime.training_run import TrainingRun
    from lightning_dynatrain.vps.topology import Topology


class AheadBuildError(DynaTrainError):
    """Building a world change's target ahead failed on a member: the change cannot be made."""


class WorldChangePendingError(DynaTrainError):
    """A layout switch was asked for while a world change is built ahead from the current layout."""


@dataclass
class AheadChange:
    """One world change being built ahead, on this process (see the module docstring)."""

    generation: int
    choice: "LayoutChoice"
    borrowed: "BorrowedWorld | None" = None
    """The next world's group, borrowed (``None``: this process leaves)."""
    groups: "ProcessGroupCache | None" = None
    """The next world's first groups: the target's."""
    topology: "Topology | None" = None
    """The next world's nodes."""
    setup: "SwitchSetup | None" = None
    pending: "PendingSwitch | None" = None
    watch: "SwitchWatch | None" = None
    """The next world's switch watch (a grow's switch runs under it), made with its groups."""

    @classmethod
    def start(cls, run: "TrainingRun", change: "WorldChange", choice: "LayoutChoice",
              borrowed: "BorrowedWorld | None", *, node_rank: int, kept: "WorldGroupCaches | None" = None,
              ) -> "AheadChange":
        """Make the target's groups and the topology on the borrowed next world, then start the build
        (collective over the next world; a leaver, with ``borrowed=None``, does nothing). ``kept``:
        the next world is a kept one, with these caches (a layout seen in it makes no group);
        ``node_rank``: this process's node (the topology's)."""
        from lightning_dynatrain.megatron.ahead import prepare_world_switch
        from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, prepare_groups
        from lightning_dynatrain.runtime.world_topology import gather_topology

        if borrowed is None:
            return cls(change.new.generation, choice)
        groups = kept.groups if kept is not None else ProcessGroupCache()
        pgs = prepare_groups(choice.layout, installed=run.layout, seed=run.seed, groups=groups,
                             world=borrowed, installed_groups=run.switcher.groups)
        with borrowed:  # after the groups, as a joiner's set-up runs them (its watch too, for a grow)
            topology = gather_topology(node_rank)
            watch = run.switcher.make_watch() if change.grows else None
        # a grow's switch runs over the new world, a shrink's over the old one (the leavers send)
        setup = run.switcher.world_change_setup(run.recipe, run.optimizer_settings,
                                                topology=topology if change.grows else None, grows=change.grows)
        over = change.new if change.grows else change.old
        process = over.rank_of(change.me)
        assert process is not None
        pending = prepare_world_switch(run.state, choice.layout, setup, pgs=pgs, next_world=borrowed.group,
                                       members=change.members, process=process)
        return cls(change.new.generation, choice, borrowed=borrowed, groups=groups, topology=topology, setup=setup,
                   pending=pending, watch=watch)

    def built_everywhere(self) -> bool:
        """Whether every member of the running world has its build (one small all-reduce over it;
        every member calls it at the same boundaries).

        Raises:
            AheadBuildError: a member's build failed (on every member; that member logged why).
        """
        from lightning_dynatrain.transition.comm import default_device

        ended = self.pending is None or self.pending.done
        failed = ended and self.pending is not None and self.pending.failed
        votes = torch.tensor([float(ended), float(failed)], device=default_device(None))
        dist.all_reduce(votes)
        if votes[1].item() > 0:
            raise AheadBuildError(
                f"building the next world's {self.choice.layout} ahead failed on {int(votes[1].item())} member(s) "
                "(each logged its error)", hint="OnNodeChange(ahead=False) builds the target in the change's pause")
        return int(votes[0].item()) == dist.get_world_size()

    def prepared(self) -> "PreparedSwitch | None":
        """The prepared switch (after ``built_everywhere``); ``None`` for a leaver."""
        return self.pending.result() if self.pending is not None else None

    def close(self) -> None:
        """The process closes with this change pending: what it made goes (``drop``: a build still in
        a collective on those groups fails), then the build's thread ends (``thread_end``)."""
        self.drop()
        if self.pending is not None:
            self.pending.end(BUILD_END_WAIT)

    def drop(self) -> None:
        """The change will not come: destroy what was made on the next world. A build still waiting
        in its all-gather for a joiner that died then fails, as expected, and is let go."""
        if self.pending is not None:
            self.pending.abandon()
        if self.watch is not None:
            self.watch.close()
        if self.groups is not None and (self.borrowed is None or self.borrowed.kept is None):  # a kept world's stay
            self.groups.close()
        if self.borrowed is not None:
            self.borrowed.forget()


__all__ = ["AheadBuildError", "AheadChange", "WorldChangePendingError"]
