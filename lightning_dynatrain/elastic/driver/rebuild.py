"""Survivors go on: a member died without leaving; the others rebuild the state in a world of their own.

Every survivor runs this in its main thread, through the one recovery guard
(``recovery.recover_or_raise``), after one of its collectives failed (inside a training step, in a
switch, or at a step boundary), or at a boundary where the store's record came first
(``MemberLostError``):

1. **abandon** the old world (``ElasticSession.abandon_world``): a peer waiting on this process fails
   at once and comes here too;
2. **agree**: the store's record of the survivors' world (the store process names the silent within
   ``suspect_after`` of the first report; ``elastic/server.py``);
3. **world**: every survivor builds and installs that world, with fresh group caches;
4. **gather** what each survivor holds: the step its state is the result of (``StepProgress``: did
   megatron's optimizer step return?), where its loop is, and its node (the new world's topology);
5. **source**: the newest step whose holders among the survivors hold every box
   (``vps.recovery_source``); survivors at another step receive like every destination. When no
   step is whole (a ZeRO-1 shard, a tp/pp shard at dp1 went with the dead), the state goes back to
   the newest in-memory snapshot and the steps since run again (``snapshots.py``,
   with ``OnNodeChange(snapshot_every=N)``); without one the job ends with ``MemberFailedError``
   naming the boxes and the checkpoint to resume from: never a mix of steps;
6. **switch** to the layout the policy picks for the survivors' world (``hot_switch`` over the new
   world, every box from a holder at that step), installed as training's state;
7. **redo**: a step in flight whose state is the step before is run again at the new layout on the
   same global batch (``redo``); one whose result survived counts as done, once, with its loss.
   Steps whose result is lost and computed again (``steps_redone``) are 0 when replicas hold it all.

A switch that lost a member (``SwitchFailedError``) is recovered from too: where it freed old state
as it moved it, no step is whole on the survivors and step 5 goes to the snapshot at once; so does
a death in a rollout phase that had freed the training shards of the weights (``keep_weights=False``,
``transition.errors.freed_state``). A
shrink's switch that lost only its leavers leaves the running world whole: ``recover_in_world``
runs steps 4-7 in it, reading the state as the old world's ranks held it.

The figures of each recovery (``RecoveryReport``) are logged like a world change's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_dynatrain.elastic.failure_watch import MemberFailedError
from lightning_dynatrain.elastic.world import retire
from lightning_dynatrain.vps.errors import StateLostError
from lightning_dynatrain.vps.recovery_source import SurvivorState, recovery_source

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.driver.driver import ElasticDriver
    from lightning_dynatrain.elastic.records import Membership
    from lightning_dynatrain.megatron.step_progress import StepProgress

#: how long a survivor waits for the store to name the dead (beyond its ``suspect_after``)
AGREE_TIMEOUT = 60.0


@dataclass(frozen=True)
class RecoveryReport:
    """What one recovery cost (the same on every survivor but ``redone``'s loss)."""

    step: int
    """The optimizer step the new world's state is the result of (training goes on with the next)."""
    failed: tuple[str, ...]
    old_world: int
    new_world: int
    src: str
    dst: str
    steps_redone: int
    """Steps completed on some survivor whose result was lost and computed again (from a snapshot)."""
    snapshot_step: int | None
    """The in-memory snapshot's step the state went back to (``None``: the survivors held it all)."""
    replay_seconds: float
    """Computing the steps redone again (part of the pause)."""
    restarted: bool
    """This survivor's step in flight restarted at the new layout (it had not completed anywhere)."""
    agree_seconds: float
    """From the failure noticed here to the store's record of the survivors."""
    world_seconds: float
    """Building and installing the survivors' world (its topology comes with the gather)."""
    transfer_seconds: float
    rebuild_seconds: float
    pause_seconds: float
    """From the failure noticed here to the new layout's state installed (the redo not included)."""
    finished_at: float
    """Wall-clock time (``time.time()``) the new layout's state was installed here (the steps redone
    computed)."""
    noticed_at: float = float("nan")
    """Wall-clock time the failure was first noticed here: the store's record read (by the watchdog,
    when the store said it recorded one), or a collective that failed, whichever came first."""
    noticed_by: str = ""
    """What made this survivor leave what it was doing: ``"store"`` (the store's record, read by the
    watchdog: at a step boundary, or at a layer of the step in flight), else the type of the error
    its failed call raised (a collective's, a switch's)."""

    def __str__(self) -> str:
        return (f"[dynatrain] step {self.step}: member(s) {', '.join(self.failed)} lost; world {self.old_world} -> "
                f"{self.new_world}, {self.src} -> {self.dst} from the state of step {self.step} in "
                f"{self.pause_seconds:.2f} s (agreement {self.agree_seconds:.2f} s, world {self.world_seconds:.2f} s, "
                f"build {self.rebuild_seconds:.2f} s, transfer {self.transfer_seconds:.3f} s, steps again "
                f"{self.replay_seconds:.2f} s); "
                f"{self.steps_redone} step(s) redone"
                + (f" from the in-memory snapshot of step {self.snapshot_step}" if self.snapshot_step is not None
                   else ""))


@dataclass(frozen=True)
class Recovered:
    """What the step in flight does next: run again at the new layout (``redo``), or count as done
    with ``loss`` (``nan`` where no survivor had reduced it)."""

    redo: bool
    loss: float
    report: RecoveryReport


def recover(driver: "ElasticDriver", *, error: BaseException | None = None,
            record: "Membership | None" = None, progress: "StepProgress | None" = None,
            state_world: "Membership | None" = None, was_rank_zero: bool | None = None,
            noticed: float | None = None) -> Recovered:
    """Steps 1-7 of the module docstring on this survivor; ``error``: the collective that failed,
    ``record``: the survivors' world when the store's record came first, ``progress``: the step in
    flight (``None`` at a boundary), ``state_world``: the world whose ranks hold the state when it is
    not the running one (a shrink's switch failed on a member that stays: the world before it; a
    recovery that lost another member: the world before the first), ``was_rank_zero``: whether this
    process was rank 0 of that world (its loggers' files are then its own), ``noticed``: when the
    failure was first noticed here (``time.perf_counter()``; an attempt that lost another member
    came before this one), the start of the figures."""
    session, run = driver.session, driver.run
    assert session is not None and session.world is not None
    start = time.perf_counter() if noticed is None else noticed
    session.abandon_world()  # (1)
    if driver.snapshots is not None:
        driver.snapshots.quiesce()
    if record is None:  # (2)
        cause = f"{type(error).__name__}: {error}" if error is not None else "a member failed"
        record = session.failures.await_survivors(AGREE_TIMEOUT, cause=cause)
        if record is None:
            raise MemberFailedError(session.failure or f"a collective failed ({cause}) and the job's store named no "
                                    f"failed member in {AGREE_TIMEOUT:.0f} s",
                                    hint="see the other processes' logs; restart the job from its last checkpoint") \
                from error
    agreed = time.perf_counter()
    state_world = state_world or session.world
    driver.drop_ahead()
    old_caches = run.switcher.world_caches()
    was_rank_zero = session.rank == 0 if was_rank_zero is None else was_rank_zero
    old_groups = session.recover_into(record)  # (3)
    driver.front.rank_changed()
    groups = run.switcher.new_world_groups()
    retired = (old_caches.subgroups, old_caches.groups, old_groups.groups)  # abandoned: destroyed here (local)
    return _go_on(driver, error=error, progress=progress, state_world=state_world, groups=groups,
                  retired=retired, was_rank_zero=was_rank_zero, new_world=True,
                  times=(start, agreed, time.perf_counter()))


def recover_in_world(driver: "ElasticDriver", *, error: BaseException,
                     state_world: "Membership", retired: tuple, was_rank_zero: bool,
                     noticed: float | None = None) -> Recovered:
    """Steps 4-7 only: the running world is whole, but the state it was moving is not (a leaver died
    handing its state off in a shrink's switch, which ran over ``state_world``, the world before;
    ``retired``: that world's caches and groups, destroyed here)."""
    session = driver.session
    assert session is not None and session.world is not None
    start = time.perf_counter() if noticed is None else noticed
    if driver.snapshots is not None:
        driver.snapshots.quiesce()  # (its group spans the world before)
    return _go_on(driver, error=error, progress=None, state_world=state_world,
                  groups=driver.run.switcher.groups, retired=retired, was_rank_zero=was_rank_zero,
                  times=(start, start, start))


def _go_on(driver: "ElasticDriver", *, error: BaseException | None,
           progress: "StepProgress | None", state_world: "Membership", groups, retired: tuple,
           was_rank_zero: bool, times: tuple[float, float, float], new_world: bool = False) -> Recovered:
    """Steps 4-7 in the survivors' installed world (``groups``: its group cache), from the state the
    ranks of ``state_world`` held; ``times``: when the failure was noticed, agreed on, the world built;
    ``new_world``: the world is new, its topology comes with the gather (each survivor's node)."""
    from lightning_dynatrain.runtime.world_topology import this_node, topology_of

    session = driver.session
    assert session is not None
    old_rank = state_world.rank_of(session.me)
    assert old_rank is not None
    in_step = progress is not None
    losses = dict([driver.last_loss] if driver.last_loss is not None else [])
    if in_step and progress.loss is not None:
        losses[progress.step] = progress.loss
    step = driver.front.global_step
    mine = {"old_rank": old_rank, "global_step": step, "in_step": in_step,
            "state": step + int(in_step and progress.stepped), "losses": losses,
            "snapshot": driver.snapshots.holding() if driver.snapshots is not None else None,
            "node": this_node(driver.node_rank)}
    everyone: list[dict] = [{}] * session.size
    try:
        dist.all_gather_object(everyone, mine)  # (4)
        if new_world:
            driver.run.switcher.new_world(topology_of([e["node"] for e in everyone]))
        return _switch_and_redo(driver, everyone, error=error, in_step=in_step, state_world=state_world,
                                groups=groups, was_rank_zero=was_rank_zero, times=times)
    finally:  # the old world's groups (abandoned): destroyed here (local), also when this attempt fails
        retire_world(retired)


def retire_world(retired: tuple) -> None:
    """Destroy an abandoned world's groups (local): its subgroup and megatron group caches, then
    its own groups (``retired``, in that order)."""
    old_subgroups, old_caches, old_groups = retired
    old_subgroups.close()
    old_caches.close()
    retire(old_groups)


def _switch_and_redo(driver: "ElasticDriver", everyone: list[dict], *,
                     error: BaseException | None, in_step: bool, state_world: "Membership", groups,
                     was_rank_zero: bool, times: tuple[float, float, float]) -> Recovered:
    """Steps 5-7, once every survivor's ``everyone`` entry is known."""
    from lightning_dynatrain.transition.errors import freed_state
    from lightning_dynatrain.megatron.hot_switch import hot_switch
    from lightning_dynatrain.megatron.parallel_state_adapter import initialize_for_layout
    from lightning_dynatrain.megatron.state_bridge import precision_of

    session, run, front = driver.session, driver.run, driver.front
    assert session is not None
    start, agreed, world_built = times
    global_step = front.global_step
    src = run.layout
    assert session.world is not None  # the members of the world the state was in that are not here: the lost
    failed = tuple(m for m in state_world.members if session.world.rank_of(m) is None)
    precision = precision_of(run.state.model, run.state.optimizer)
    setup = run.switcher.world_change_setup(run.recipe, run.optimizer_settings)
    old_size, snapshot = len(state_world.members), None
    try:  # (5)
        if freed_state(error) or driver.snapshots is not None and driver.snapshots.restored:
            raise StateLostError(f"a survivor freed part of its state of step {global_step} (a switch that failed "
                                 "as it moved it, or a rollout phase without keep_weights), or wrote the snapshot "
                                 "back into it already",
                                 hint="only a snapshot holds the state of one step now")
        source = recovery_source(setup.spec, src, precision, old_size=old_size,
                                 survivors=[SurvivorState(e["old_rank"], e["state"]) for e in everyone])
        members, step = source.members, source.step
    except StateLostError as err:
        try:
            if driver.snapshots is None:
                raise
            snapshot = driver.snapshots.source(setup, everyone, old_size=old_size, lost=err)
        except StateLostError as lost:
            raise MemberFailedError(f"member(s) {', '.join(failed)} died holding state no survivor has: {lost}",
                                    hint=f"restart the job from {_resume_from(driver)} (a layout with data-parallel "
                                    "replicas, without zero1, survives the loss of a rank; so does any layout with "
                                    "OnNodeChange(snapshot_every=N))") from err
        members, step = snapshot.members, max(e["state"] for e in everyone)
    _check_the_loops_agree(everyone, step)
    choice = driver.choose_for(session.size, members=members)
    target = choice.layout
    initialize_for_layout(target, seed=run.seed, groups=groups)  # (6)
    held = driver.snapshots.held(snapshot.step) if snapshot is not None else None
    if held is not None:  # the state comes from the snapshot, at the layout it was taken at
        src = held.layout
    result = hot_switch(run.state, target, setup, groups=groups, members=members,
                        watch=run.switcher.world_watch(), restore_source_groups=False, held=held)
    del held  # (the switch freed what it moved)
    run.install(result.state)
    known = {s: loss for e in everyone for s, loss in e["losses"].items()}
    replay_seconds = 0.0
    if snapshot is not None:  # (6b) the dead's boxes from the keepers, the lost steps again; a member that
        driver.snapshots.fill(snapshot, everyone, precision)  # dies meanwhile: back to the snapshot (recovery.py)
        replay_start = time.perf_counter()
        known.update(driver.snapshots.replay(snapshot.step + 1, step))
        replay_seconds = time.perf_counter() - replay_start
    if driver.snapshots is not None:
        driver.snapshots.after_state_change(step)
    if session.rank == 0 and not was_rank_zero:  # the old rank 0 died: its files are as it left them
        front.continue_logs()
    redo = in_step and step == global_step  # (7)
    report = RecoveryReport(
        step=step, failed=failed, old_world=old_size, new_world=session.size,
        src=str(src), dst=str(target), restarted=redo,
        steps_redone=max(e["state"] for e in everyone) - (snapshot.step if snapshot is not None else step),
        snapshot_step=snapshot.step if snapshot is not None else None, replay_seconds=replay_seconds,
        agree_seconds=agreed - start, world_seconds=world_built - agreed,
        transfer_seconds=result.phases.get("engine", 0.0), rebuild_seconds=result.rebuild_seconds,
        pause_seconds=time.perf_counter() - start, finished_at=time.time(),
        noticed_at=min(time.time() - (time.perf_counter() - start),
                       session.failures.known_at.get(session.world.generation, float("inf"))),
        noticed_by="store" if error is None else type(error).__name__)
    front.warn(str(report))
    return Recovered(redo=redo, loss=known.get(global_step + 1, float("nan")), report=report)


def _resume_from(driver: "ElasticDriver") -> str:
    path = driver.front.latest_checkpoint()  # the run's newest checkpoint, or the one it resumed from
    return f"its last checkpoint, {path}" if path else "its last checkpoint (this fit wrote none: add a ModelCheckpoint)"


def _check_the_loops_agree(everyone: list[dict], step: int) -> None:
    """After the recovery every survivor runs step ``step + 1`` next: one inside step ``g + 1``
    (``g``: its global step) redoes it when ``step == g`` or ends it, done, when ``step == g + 1``
    (a survivor that passed the step's last collective may be a step ahead of one that failed in
    it); one at the boundary after ``g`` needs ``step == g``."""
    cannot = [e["old_rank"] for e in everyone
              if step not in ((e["global_step"], e["global_step"] + 1) if e["in_step"] else (e["global_step"],))]
    if cannot:
        where = sorted((e["old_rank"], e["global_step"], e["in_step"]) for e in everyone)
        raise MemberFailedError(f"the state of step {step} cannot be continued from on the survivors of old rank(s) "
                                f"{cannot} (old rank, global step, inside a step: {where})",
                                hint="restart the job from its last checkpoint")


__all__ = ["AGREE_TIMEOUT", "Recovered", "RecoveryReport", "recover", "recover_in_world", "retire_world"]
