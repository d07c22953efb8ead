"""The one recovery guard: a member lost without leaving, wherever its death was noticed, and the way back.

Every place of an elastic run that catches a failed collective (a training step, a layout switch,
a step boundary's vote or broadcast, a world change's switch) hands the error to
``recover_or_raise`` with where it failed (``FailedAt``). From that and from what the survivors
still hold, the guard takes the one way back there is, or raises the error again:

=============================================  ==========================  ==========================================
where it failed (``FailedAt``)                  what is whole               the way back
=============================================  ==========================  ==========================================
a training step (``progress``), a layout        the last step's state on    ``rebuild.recover``: agree on a world
switch, a boundary's vote or broadcast; or      the survivors (replicas),   without the dead, switch to the policy's
the store named the dead first                  else an in-memory           layout there from the replicas (or the
(``MemberLostError``)                           snapshot                    snapshot, the lost steps run again),
                                                                            redo the step in flight
a grow's switch (``grow``): refused, or failed  the old world and its       ``go_back``: the old world, its groups and
with the old state whole, or only joiners lost  state (or, freed, the       layout again; with state freed, the
after freeing state with snapshots on           members' snapshot)          snapshot and the steps since
                                                                            (``SnapshotKeeper.back_in_place``)
a shrink's switch (``shrink``) that lost only   the running world           ``rebuild.recover_in_world``: the state
leavers                                                                     rebuilt in it from what the old world's
                                                                            survivors hold
a shrink's switch that lost a member that       the old world's state on    ``rebuild.recover`` from the old world's
stays                                           the survivors               state; the old world's groups retired
=============================================  ==========================  ==========================================

Anything else (``recover=False``, a process that left, an error that is no member's death, state
no survivor and no snapshot holds) is raised, as ``MemberFailedError`` where a recovery found the job
cannot go on. A member dying during a recovery is recovered from again, without it too (at most
``MAX_RECOVERY_ATTEMPTS`` in a row): before the state moved, from what the survivors hold; after it
moved to the new layout from a snapshot (in the keepers' fill, or as the lost steps run again), from
the same snapshot again (``SnapshotKeeper.restored``). Each recovery's figures are a ``rebuild.RecoveryReport``.

What every front end runs under the guard in an elastic run, so that the Lightning strategy and the
loop engine recover alike: a training step (``step_recovering``), a layout switch
(``switch_recovering``) and a rollout phase (``rollout_recovering``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_dynatrain.elastic.failure_watch import MemberFailedError, MemberLostError, is_communication_failure
from lightning_dynatrain.elastic.world import retire
from lightning_dynatrain.runtime.reconfig_report import ReconfigReport
from lightning_dynatrain.transition.errors import SwitchFailedError, freed_state, mark_refused, was_refused

if TYPE_CHECKING:
    import torch

    from lightning_dynatrain.elastic.driver.driver import ElasticDriver
    from lightning_dynatrain.elastic.driver.rebuild import Recovered
    from lightning_dynatrain.elastic.records import Membership
    from lightning_dynatrain.elastic.session import WorldChange
    from lightning_dynatrain.elastic.world_cache import KeptWorld
    from lightning_dynatrain.megatron.step_progress import StepProgress
    from lightning_dynatrain.runtime.rollout import RolloutPolicy
    from lightning_dynatrain.runtime.switcher import WorldGroupCaches
    from lightning_dynatrain.vps.layout import ParallelConfig
    from lightning_dynatrain.vps.topology import Topology

#: recoveries tried in a row when members keep dying during one (each agrees on a world without them)
MAX_RECOVERY_ATTEMPTS = 3


@dataclass(frozen=True)
class RetainedWorld:
    """What a grow's old members keep of their world until its switch succeeded (``go_back``)."""

    world: "KeptWorld | None"  # its default group and groups (``ElasticSession.swap`` returned them)
    caches: "WorldGroupCaches"  # the run's caches of its megatron and switch groups
    topology: "Topology | None"


@dataclass(frozen=True)
class GrowInFlight:
    """A grow whose switch failed: the change, its step, the old world kept until then."""

    change: "WorldChange"
    step: int
    old: RetainedWorld


@dataclass(frozen=True)
class ShrinkInFlight:
    """A shrink whose switch (over the old world) failed: the change, the old world and its caches."""

    change: "WorldChange"
    left_world: "KeptWorld | None"
    old_caches: "WorldGroupCaches"
    was_rank_zero: bool


@dataclass(frozen=True)
class FailedAt:
    """Where a member's loss was noticed (see the module docstring's table); the default: at a step
    boundary or in a layout switch, with the state of the last step."""

    progress: "StepProgress | None" = None
    """Inside a training step: how far it got."""
    grow: GrowInFlight | None = None
    shrink: ShrinkInFlight | None = None


def recovers(driver: "ElasticDriver", err: BaseException) -> bool:
    """``err`` is a collective that failed, or a switch a rank went missing in, and the survivors go
    on after it: from the state they hold, or, where some of it was freed (a switch that moved it,
    a rollout phase without ``keep_weights``: ``freed_state``), from the in-memory snapshot (if any)."""
    if not driver.recover_from_loss or driver.session is None or driver.left:
        return False
    if freed_state(err) and driver.snapshots is None:
        return False
    if isinstance(err, SwitchFailedError):
        return err.rank is not None or is_communication_failure(err)
    return is_communication_failure(err)


def recover_or_raise(driver: "ElasticDriver", err: BaseException, at: FailedAt = FailedAt()) -> "Recovered | None":
    """The survivors go on after ``err``, noticed where ``at`` says, by the way back the module
    docstring's table gives; what the step in flight does next (``None`` where no step was in flight
    or the change went back to its old world). Raises ``err`` again where there is no way back."""
    if at.grow is not None:
        return _grow_failed(driver, err, at.grow)
    if isinstance(err, MemberLostError):  # the store's record came before any collective failed here
        return _recover(driver, record=err.record, progress=at.progress)
    if not recovers(driver, err):
        raise err
    if at.shrink is not None:
        return _shrink_failed(driver, err, at.shrink)
    return _recover(driver, error=err, progress=at.progress)


def _recover(driver: "ElasticDriver", *, error: BaseException | None = None, record: "Membership | None" = None,
             progress: "StepProgress | None" = None, state_world: "Membership | None" = None,
             retired: tuple | None = None, was_rank_zero: bool = False) -> "Recovered":
    """Go on in the survivors' world (``rebuild.recover``), trying again when another member dies
    meanwhile. ``state_world``: the world whose ranks hold the state, when not the running one (a
    shrink's switch failed); with ``retired`` (that world's caches and groups), the running world
    lost nobody and only the state is rebuilt (``rebuild.recover_in_world``)."""
    from lightning_dynatrain.elastic.driver.rebuild import recover, recover_in_world

    session = driver.session
    driver.detected_at, driver.step_fault = None, None  # (a test's fault fires in the first world only)
    assert session is not None and session.world is not None
    state_world = state_world or session.world
    was_rank_zero = was_rank_zero or session.rank == 0
    noticed = time.perf_counter()  # (the figures span every attempt)
    for attempt in range(1, MAX_RECOVERY_ATTEMPTS + 1):
        try:
            if retired is not None:
                assert error is not None
                outcome = recover_in_world(driver, error=error, state_world=state_world, retired=retired,
                                           was_rank_zero=was_rank_zero, noticed=noticed)
            else:
                outcome = recover(driver, error=error, record=record, progress=progress, state_world=state_world,
                                  was_rank_zero=was_rank_zero, noticed=noticed)
            break
        except Exception as err:  # another member died during the recovery: again, without it too
            lost = isinstance(err, MemberLostError)  # (the store recorded it while the world was built)
            if attempt == MAX_RECOVERY_ATTEMPTS or isinstance(err, MemberFailedError) or \
                    not (lost or recovers(driver, err)):
                raise  # (MemberFailedError: the recovery itself found the job cannot go on)
            driver.front.warn(f"[dynatrain] a member died during the recovery ({type(err).__name__}: {err}); "
                              "the survivors agree on a world without it too")
            freed = freed_state(error)  # (a state freed stays freed: the snapshot or nothing)
            if lost:
                record, retired = err.record, None
            else:
                error, record, retired = error if freed else err, None, None
    driver.recoveries.append(outcome.report)
    driver.last_boundary = time.perf_counter()  # the pause is not a step
    return outcome


def _shrink_failed(driver: "ElasticDriver", err: BaseException, shrink: ShrinkInFlight) -> "Recovered":
    """A shrink's switch lost a member: when only leavers went missing, the running world (the
    survivors, installed) is whole and the state is rebuilt in it from what the old world's
    survivors hold; when a member that stays went missing too, the survivors agree on a world
    without it first. Either reads the state as the old world's ranks held it, and the old world's
    groups go."""
    from lightning_dynatrain.elastic.driver.rebuild import retire_world

    change = shrink.change
    assert shrink.left_world is not None
    leavers = {change.old.rank_of(m) for m in change.old.members if m not in change.new.members}
    missing = set(getattr(err, "missing", ()))
    old_groups = (shrink.old_caches.subgroups, shrink.old_caches.groups, shrink.left_world.groups.groups)
    if missing and missing <= leavers:
        return _recover(driver, error=err, state_world=change.old, retired=old_groups,
                        was_rank_zero=shrink.was_rank_zero)
    outcome = _recover(driver, error=err, state_world=change.old)
    retire_world(old_groups)
    return outcome


def _grow_failed(driver: "ElasticDriver", err: BaseException, grow: GrowInFlight) -> None:
    """A grow's switch failed: back to the old world where its state is whole (refused, or rolled
    back), or where only joiners were lost after state was freed and a snapshot holds it; else
    ``err`` again (the state of this step is lost, or a rank holding it is gone)."""
    refused = was_refused(err)
    joiners = {grow.change.new.rank_of(m) for m in grow.change.new.members if m not in grow.change.old.members}
    missing = set(getattr(err, "missing", ()))
    joiners_lost = bool(missing) and missing <= joiners and driver.snapshots is not None and recovers(driver, err)
    if not refused and not joiners_lost:
        raise err
    go_back(driver, grow, err)
    if not refused:  # the switch freed old state: the snapshot's state, and the steps since again
        assert driver.snapshots is not None
        snapshot_step, seconds = driver.snapshots.back_in_place(grow.step)
        driver.front.warn(f"[dynatrain] step {grow.step}: the state went back to the in-memory snapshot of step "
                          f"{snapshot_step}; {grow.step - snapshot_step} step(s) redone in {seconds:.2f} s")
    return None


def go_back(driver: "ElasticDriver", grow: GrowInFlight, err: BaseException) -> None:
    """A grow's switch failed with the old state whole on every old member (a joiner went missing
    or stalled, under ``switch_safety="keep_old"`` or before anything moved; or the switch was
    refused), or after freeing some of it with only joiners lost (the caller then puts the
    snapshot's state back): the old world, its groups and its layout's megatron groups come back,
    the new world's groups are destroyed, and training goes on. The joiners fail; the store, which
    was not told of the new world, cancels the change once their heartbeats stop."""
    from lightning_dynatrain.megatron.parallel_state_adapter import initialize_for_layout

    session, run, old = driver.session, driver.run, grow.old
    assert session is not None and old.world is not None and old.topology is not None
    new_world = session.swap_back(grow.change, old.world)
    run.switcher.new_world_groups(kept=old.caches)  # the new world's watch and subgroups go
    retire(new_world.groups)
    initialize_for_layout(run.layout, seed=run.seed, groups=old.caches.groups)  # cached: makes none
    run.switcher.new_world(old.topology)
    driver.front.rank_changed()
    driver.rolled_back.append({"step": grow.step, "change": str(grow.change), "layout": str(run.layout),
                               "error": f"{type(err).__name__}: {err}"})
    how = "with the old state whole" if was_refused(err) else "after freeing old state (only joiners were lost)"
    driver.front.warn(f"[dynatrain] step {grow.step}: {grow.change} failed {how}, so it was rolled back: "
                      f"training goes on at {run.layout} on the world of {len(grow.change.old.members)} "
                      f"({type(err).__name__}: {err})")


def step_recovering(driver: "ElasticDriver", step: int, batch: Mapping[str, "torch.Tensor"], *, lr: float,
                    weight_decay: float, forward_step: Callable | None = None,
                    before_redo: Callable[[], None] | None = None) -> float:
    """The training step that ends at global step ``step``, over the global ``batch``; its loss. A
    member lost in it is recovered from here (``recover_or_raise``) and the step runs again at the
    survivors' layout on the same batch, or counts as done where its result survived. With
    snapshots the step is logged first (what a recovery from a snapshot runs again).
    ``before_redo``: what the front end does before a step again (Lightning: its per-step collectives)."""
    if driver.snapshots is not None:
        driver.snapshots.record(step, batch, lr=lr, weight_decay=weight_decay, forward_step=forward_step)
    while True:
        progress = driver.progress(step)
        try:
            loss = driver.run.train_step(batch, lr=lr, weight_decay=weight_decay, progress=progress,
                                         forward_step=forward_step)
            driver.last_loss = (progress.step, loss)
            return loss
        except Exception as err:
            outcome = recover_or_raise(driver, err, FailedAt(progress=progress))
        assert outcome is not None
        if not outcome.redo:
            return outcome.loss
        if before_redo is not None:
            before_redo()


def switch_recovering(driver: "ElasticDriver", layout: "ParallelConfig", *, step: int,
                      deferred: bool = False) -> tuple[ReconfigReport, bool]:
    """The run's switch to the checked ``layout`` after step ``step``, and whether a member was lost
    in it (the survivors then went on at the layout of their world, and the report only says where
    the run is). A snapshot in flight ends first and the next is taken after the switch.

    Raises:
        WorldChangePendingError: (refused, nothing moved) a world change is built ahead.
        The switch's own errors, where there is no way back (``recover_or_raise``).
    """
    run = driver.run
    src = run.layout
    if layout != src and driver.preparing is not None:
        from lightning_dynatrain.elastic.driver.ahead_change import WorldChangePendingError

        raise mark_refused(WorldChangePendingError(
            f"a switch to {layout} was asked for while a world change to {driver.preparing} is built "
            f"ahead from {src}", hint="switch after the change (a step or two later), or build world changes "
            "in their pause: OnNodeChange(ahead=False)"))
    snapshots = driver.snapshots if layout != src else None
    if snapshots is not None:
        snapshots.before_state_change()
    try:
        report = run.switch(layout, step=step, deferred=deferred)
    except Exception as err:  # a member died in the switch with the old state whole: survivors go on
        recover_or_raise(driver, err)
        return ReconfigReport(step=step, src=str(src), dst=str(run.layout), deferred=deferred), True
    if not report.noop and snapshots is not None:
        snapshots.after_state_change(step)
    return report, False


@contextmanager
def rollout_recovering(driver: "ElasticDriver", layout: "str | ParallelConfig", *, park: str, keep_weights: bool,
                       step: int) -> "Iterator[RolloutPolicy]":
    """``TrainingRun.rollout`` between two steps of an elastic run: the snapshot in flight ends first
    (the phase leaves the state as it was, so the snapshot stays valid). A member lost in the phase
    is recovered from as at the step boundary the phase began at: from the survivors' training state
    where the weights were kept, else (their training shards freed, ``keep_weights=False``) from the
    in-memory snapshot and the steps since run again; then ``RolloutInterrupted`` drops the phase's
    results (the front end runs the training step again).

    Raises:
        RolloutInterrupted: a member died in the phase and the survivors went on.
        RolloutError: a member died in a phase that freed the training weights, and no snapshot is kept.
    """
    from lightning_dynatrain.runtime.rollout import RolloutError, RolloutInterrupted

    if driver.snapshots is not None:
        driver.snapshots.before_state_change()
    try:
        with driver.run.rollout(layout, park=park, keep_weights=keep_weights) as policy:
            yield policy
    except Exception as err:
        if freed_state(err) and driver.snapshots is None and is_communication_failure(err):
            raise RolloutError(f"a member died during the rollout at step {step}, which had freed the training "
                               "shards of the weights (keep_weights=False), and the job keeps no in-memory "
                               "snapshot: the survivors cannot rebuild them",
                               hint="resume from the last checkpoint; where a death may interrupt a rollout, "
                               "keep the weights (keep_weights=True) or take snapshots "
                               "(OnNodeChange(snapshot_every=N))") from err
        if not recovers(driver, err):
            raise
        recover_or_raise(driver, err)
        raise RolloutInterrupted(f"step {step}: a member died during the rollout; the survivors went on at "
                                 f"{driver.run.layout} and run the step again",
                                 hint="choose the rollout layout from the world size where members may die") \
            from err


__all__ = ["FailedAt", "GrowInFlight", "MAX_RECOVERY_ATTEMPTS", "RetainedWorld", "ShrinkInFlight", "go_back",
           "recover_or_raise", "recovers", "rollout_recovering", "step_recovering", "switch_recovering"]
