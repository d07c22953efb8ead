"""In-memory snapshots in an elastic fit: taken at boundaries, gone back to when a member's death
took state no survivor holds (``OnNodeChange(snapshot_every=N)``).

``SnapshotKeeper`` is the driver's side: after every ``N``-th optimizer step (and at the first
boundary of each world and layout) it starts ``megatron.snapshot.Snapshots.take`` and trains on;
the next optimizer step's update waits for this rank's own copy (``before_update``); any switch or
world change first waits for the snapshot in flight (``before_state_change``) and, once the state
moved, forgets it (``after_state_change``). It also logs each step's global batch and learning rate
(``step_log.py``) from the snapshot on.

``rebuild.recover`` goes back to a snapshot when a death took boxes no survivor holds:

1. the survivors agree on the snapshot step ``S`` (``vps.recovery_source.snapshot_source``: each
   one's own copy, and a keeper's copy of each box only the dead held) and on the step ``T`` the
   state had reached (the newest a survivor completed);
2. the recovery switch moves each survivor's own copy of step ``S`` (``held``: the live state is
   dropped) to the new layout, the dead's boxes left as holes, and the keepers fill them
   (``megatron.snapshot_fill``);
3. steps ``S+1 .. T`` run again at the new layout from the step log (``replay``): their batches and
   learning rates, so the result is the computation of the lost steps at the new layout, and the
   loop's data position and schedule, which never went back, agree with it.

A member that dies during 2 or 3 (the state has moved to the new layout, the snapshot has not):
the survivors go back to the same snapshot again, without it too (``restored``), as long as each
box has a holder or a keeper left among them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_dynatrain.elastic.failure_watch import MemberFailedError
from lightning_dynatrain.elastic.session import RECOVERY_FAULT_ENV
from lightning_dynatrain.megatron.snapshot import SnapshotFigures, Snapshots
from lightning_dynatrain.elastic.driver.step_log import StepLog
from lightning_dynatrain.vps.errors import StateLostError
from lightning_dynatrain.vps.recovery_source import SnapshotHolding, SnapshotSource, snapshot_source
from lightning_dynatrain.vps.snapshot_plan import snapshot_plan

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.driver.front import TrainingFront
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup
    from lightning_dynatrain.megatron.snapshot import HeldState
    from lightning_dynatrain.runtime.training_run import TrainingRun
    from lightning_dynatrain.vps.spec import Precision

#: how long a recovery waits for a snapshot in flight to end once the old world is abandoned
SNAPSHOT_WAIT = 30.0


class SnapshotKeeper:
    """An elastic fit's snapshots and step log (see the module docstring)."""

    def __init__(self, run: "TrainingRun", front: "TrainingFront", every: int, *, buffers: int = 1) -> None:
        self.run, self.front = run, front
        self.snapshots = Snapshots(every, buffers=buffers)
        self.log = StepLog()
        self._fresh = True  # a new world or layout: snapshot at the next boundary ...
        self._not_before = 1  # ... from this step on
        self.restored = False
        """A recovery went back to the snapshot (``held``) and the state has not moved on since: a
        recovery that lost another member goes back to the snapshot again."""

    @property
    def figures(self) -> "SnapshotFigures | None":
        """What the last snapshot that ended cost this rank."""
        return self.snapshots.figures

    # ------------------------------------------------------------------------ during training
    def record(self, step: int, batch: Mapping[str, torch.Tensor], *, lr: float, weight_decay: float,
               forward_step: Callable | None = None) -> None:
        self.log.record(step, batch, lr=lr, weight_decay=weight_decay, forward_step=forward_step)

    def before_update(self) -> None:
        """Called before an optimizer step's update: this rank's own copy is complete."""
        self.snapshots.wait_local()

    def at_boundary(self, step: int) -> None:
        """After optimizer step ``step``: start a snapshot when one is due (on every rank alike)."""
        from lightning_dynatrain.megatron.state_bridge import precision_of

        if not (self._fresh or step % self.snapshots.every == 0) or step < self._not_before:
            return
        state = self.run.state
        if self._fresh:  # the plan of this world and layout, made once
            from lightning_dynatrain.megatron.state_bridge import megatron_store

            spec, rank = self._setup().spec, dist.get_rank()
            plan = snapshot_plan(spec, state.layout, self.run.switcher.topology,
                                 precision_of(state.model, state.optimizer))
            self.snapshots.prepare(state.layout, spec, plan, rank)
            own = sum(t.nbytes for t in
                      megatron_store(state.chunks, state.optimizer, spec, state.layout, rank).values())
            self.front.info(f"[dynatrain] step {step}: in-memory snapshots of {state.layout} every "
                           f"{self.snapshots.every} steps, host memory of rank 0: its own copy {own / 2**20:.1f} MiB, "
                           f"kept for others {plan.held_bytes(rank) / 2**20:.1f} MiB"
                           f"{', twice (two buffers)' if self.snapshots.buffers == 2 else ''}; {plan}")
        staying = self.snapshots.own_steps[:self.snapshots.buffers - 1]  # (the newest, with two buffers)
        self.snapshots.take(step, state)
        self.log.drop_through(min(staying + (step,)))  # a recovery may go back to any whole snapshot
        self._fresh = False

    def before_state_change(self) -> None:
        """A switch or a world change is about to move the state: the snapshot in flight ends first
        (what it holds stays until ``after_state_change``: a switch that fails may need it)."""
        self.snapshots.wait()

    def after_state_change(self, step: int) -> None:
        """The state of optimizer step ``step`` moved (a switch, a world change, a recovery): what the
        snapshot holds no longer describes it; the first boundary after ``step`` takes one (after
        a recovery, survivors that were a step apart all reach that boundary in their loop)."""
        self.snapshots.wait()
        self.snapshots.forget()
        self._fresh, self._not_before, self.restored = True, step + 1, False

    # --------------------------------------------------------------------------- recovery
    def quiesce(self) -> None:
        """The old world was abandoned: the snapshot in flight ends (its exchange fails with a dead
        peer); what it holds is kept for going back to it (``held``)."""
        if not self.snapshots.wait(SNAPSHOT_WAIT):
            raise MemberFailedError(f"the snapshot in flight did not end within {SNAPSHOT_WAIT:.0f} s of the "
                                    "old world's abandon", hint="restart the job from its last checkpoint")
        self.snapshots.drop_group()

    def holding(self) -> dict[str, Any]:
        """What this survivor has to go back with (gathered by the recovery)."""
        return {"own": self.snapshots.own_steps, "kept": self.snapshots.kept_steps, "logged": self.log.steps()}

    def source(self, setup: "SwitchSetup", everyone: list[dict], *, old_size: int, lost: StateLostError
               ) -> SnapshotSource:
        """Step 1 of the module docstring, the same on every survivor (``everyone``: the gathered
        ``holding``s); ``StateLostError`` saying why when no snapshot holds the state."""
        plan = self.snapshots.plan
        if plan is None:
            raise lost
        holdings = [SnapshotHolding(e["old_rank"], tuple(e["snapshot"]["own"]), tuple(e["snapshot"]["kept"]))
                    for e in everyone]
        source = snapshot_source(setup.spec, plan, old_size=old_size, survivors=holdings)
        last = max(e["state"] for e in everyone)
        short = [e["old_rank"] for e in everyone
                 if not set(range(source.step + 1, last + 1)) <= set(e["snapshot"]["logged"])]
        if short:
            raise StateLostError(f"old rank(s) {short} do not hold the batches of steps {source.step + 1}..{last} "
                                 "to compute them again", hint="restart the job from its last checkpoint")
        return source

    def held(self, step: int) -> "HeldState":
        """Step 2's first half: this survivor's own copy of step ``step`` (``source.step``), the
        source of the recovery's switch (a copy of it: the snapshot stays whole, and a recovery that
        loses another member before the state moved on goes back to it again: ``restored``). The
        running state's memory is given back first (nothing reads it again): the device holds one
        state at a time."""
        from lightning_dynatrain.megatron.state import free_memory

        self.restored = True
        device = next(self.run.state.model.parameters()).device
        free_memory(self.run.state)
        return self.snapshots.held(step, device)

    def fill(self, source: SnapshotSource, everyone: list[dict], precision: "Precision") -> int:
        """Step 2's second half, at the new layout: the holes written from the keepers' copies
        (over a gloo group of the new world, made and destroyed here: the copies are host memory)."""
        from lightning_dynatrain.megatron.snapshot_fill import fill_from_kept
        from lightning_dynatrain.vps.snapshot_plan import fill_plan

        if not source.lost:
            return 0
        process = {e["old_rank"]: p for p, e in enumerate(everyone)}
        keepers = {key: process[old] for key, old in source.keepers.items()}
        state, spec = self.run.state, self._setup().spec
        pieces = fill_plan(spec, state.layout, precision, source.lost, keepers)
        host = dist.new_group(backend="gloo")
        _fault("KILL_IN_FILL")
        try:
            return fill_from_kept(state, spec, precision, pieces, self.snapshots.kept(source.step), dist.get_rank(),
                                  group=host)
        finally:
            dist.destroy_process_group(host)

    def replay(self, first: int, last: int) -> dict[int, float]:
        """Step 3: steps ``first .. last`` again at the current layout; their losses."""
        losses, start = {}, time.perf_counter()
        for logged in self.log.between(first, last):
            _fault("KILL_IN_REPLAY")
            losses[logged.step] = self.run.train_step(logged.batch, lr=logged.lr, weight_decay=logged.weight_decay,
                                                      forward_step=logged.forward_step)
        if losses:
            self.front.info(f"[dynatrain] steps {first}..{last} computed again at {self.run.layout} from the step "
                            f"log in {time.perf_counter() - start:.2f} s")
        return losses

    def back_in_place(self, step: int) -> tuple[int, float]:
        """A grow's switch freed old state and lost only joiners; the old members are back in their
        world at the old layout (``world_change.go_back``), every one of them alive: each writes its
        own copy of the snapshot back (together, the whole state of its step ``S``), its gradient
        buffers get their memory back, and steps ``S+1 .. step`` run again. Returns ``S`` and the
        seconds the steps took; ``MemberFailedError`` when the members' snapshots are not of one step."""
        held: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(held, (self.snapshots.own_steps, self.log.steps()))
        common = set.intersection(*(set(own) for own, _ in held))
        whole = [s for s in sorted(common, reverse=True)
                 if all(set(range(s + 1, step + 1)) <= set(logged) for _, logged in held)]
        if not whole:
            raise MemberFailedError(f"the grow's switch freed state and no snapshot of one step is held by every "
                                    f"member (snapshot steps {[own for own, _ in held]})",
                                    hint="restart the job from its last checkpoint")
        snapshot_step = whole[0]
        self.snapshots.restore(self.run.state, snapshot_step)
        self.snapshots.restore_gradient_memory(self.run.state)
        start = time.perf_counter()
        self.replay(snapshot_step + 1, step)
        self.after_state_change(step)
        return snapshot_step, time.perf_counter() - start

    def close(self) -> None:
        self.snapshots.wait(SNAPSHOT_WAIT)

    def _setup(self) -> "SwitchSetup":
        return self.run.switcher.world_change_setup(self.run.recipe, self.run.optimizer_settings)


def _fault(where: str) -> None:
    """Test hook: ``DYNATRAIN_RECOVERY_FAULT=KILL_IN_FILL`` (``KILL_IN_REPLAY``) kills this process
    as the keepers' fill (the first step computed again) of a recovery starts."""
    if os.environ.get(RECOVERY_FAULT_ENV) == where:
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["SNAPSHOT_WAIT", "SnapshotKeeper"]
