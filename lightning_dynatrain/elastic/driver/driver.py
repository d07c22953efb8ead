"""World changes inside a running fit: the driver of the Elastic Device Manager.

``ElasticDriver`` (one per run, made by an ``ElasticCallback`` such as ``OnNodeChange``) holds this
process's ``elastic.ElasticSession`` and does the megatron work of a change on the run
(``runtime.training_run.TrainingRun``); what it needs of the loop around the run goes through the
front end's ``front.TrainingFront`` (Lightning's: ``strategy/elastic_front.py``).

**Entering** (``enter``, from the front end's set-up): every process asks the job's store to join;
the ones a launcher started together form the first world, a process started later joins the
running job and takes part in the new world's first collectives (``joining.py``).

**Leaving**: a process asked to leave (SIGTERM, SIGUSR1, ``leave()``) keeps training until the
change's boundary, sends its state over the old world (``hot_switch.send_state``), stops its loop
(``front.stop``) with every later collective local, and exits 0. The survivors install their new
world before the transfer and build the target there (``world_change.py``, built ahead by
default: ``ahead_change.py``).

**Members lost without leaving**: every place that catches a failed collective hands it to
``recover_or_raise`` (``recovery.py``, the one guard; its docstring's table names the ways back).

Example (what ``OnNodeChange`` does at each boundary)::

    driver.at_boundary()      # one store read; a change when one is due
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_dynatrain.elastic.driver.ahead_change import AheadChange
from lightning_dynatrain.elastic.driver.change_report import ChangeReport
from lightning_dynatrain.elastic.driver.joining import broadcast_object, join_header, receive_state, receive_trainer_state
from lightning_dynatrain.elastic.driver.layout_policy import LayoutChoice, StepModel, choose_layout, parse_policy
from lightning_dynatrain.elastic.driver.recovery import recover_or_raise
from lightning_dynatrain.elastic.driver.snapshots import SnapshotKeeper
from lightning_dynatrain.elastic.driver.world_change import change_world
from lightning_dynatrain.elastic.failure_watch import MemberLostError
from lightning_dynatrain.elastic.records import job_fingerprint
from lightning_dynatrain.elastic.session import ElasticSession, WorldChange
from lightning_dynatrain.megatron.step_progress import StepFault, StepProgress
from lightning_dynatrain.runtime.step_clock import OverlapClock
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.driver.front import Launch, TrainingFront
    from lightning_dynatrain.elastic.driver.rebuild import RecoveryReport
    from lightning_dynatrain.runtime.training_run import TrainingRun
    from lightning_dynatrain.vps.members import Members


class ElasticDriver:
    """The run's elastic side (see the module docstring).

    Args:
        run: the run whose state moves at each change.
        front: the front end's side (``TrainingFront``).
        policy, memory_per_rank, step_model, heartbeat, exit_after, ahead, keep_worlds, recover,
            snapshot_every, snapshot_buffers: ``OnNodeChange``'s, which says what each does.
    """

    def __init__(self, run: "TrainingRun", front: "TrainingFront", *, policy: Any, memory_per_rank: int | None = None,
                 step_model: StepModel = StepModel(), heartbeat: float = 1.0, exit_after: float = 30.0,
                 ahead: bool = True, keep_worlds: int = 2, recover: bool = True,
                 snapshot_every: int | None = None, snapshot_buffers: int = 1) -> None:
        self.run, self.front = run, front
        self.recover_from_loss = recover
        self.snapshots = SnapshotKeeper(run, front, snapshot_every, buffers=snapshot_buffers) if snapshot_every \
            else None
        """In-memory snapshots and the step log (``snapshots.py``), or ``None``."""
        self.recoveries: list[RecoveryReport] = []
        """Every recovery from a member lost without leaving (``recovery.py``)."""
        self.step_fault = StepFault.from_environment()  # test hook (megatron.step_progress)
        self.last_loss: tuple[int, float] | None = None
        """The last step this process completed and its loss (a recovery hands it to a survivor
        whose own reduction of that loss failed)."""
        self.ahead_requested, self.keep_worlds = ahead, keep_worlds
        self.policy = parse_policy(policy)
        self.memory_per_rank, self.step_model = memory_per_rank, step_model
        self.heartbeat, self.exit_after = heartbeat, exit_after
        self.session: ElasticSession | None = None
        self.launch: Launch | None = None
        self.header: dict[str, Any] | None = None
        self.catching_up = False
        self.left = False
        self.history: list[ChangeReport] = []
        self.admitted_by: ChangeReport | None = None
        """A joiner's: the grow that admitted it (rank 0's report, ``receive_trainer_state``)."""
        self.detected_at: float | None = None
        """When the pending change was first seen here (its figures start there)."""
        self.last_boundary: float | None = None
        self._clock = OverlapClock()  # step seconds, with and without a change pending
        self._ahead: AheadChange | None = None  # the pending change, built ahead (ahead_change.py)
        self.rolled_back: list[dict[str, Any]] = []
        """World changes that failed with the old state whole and went back to the old world
        (``recovery.go_back``)."""

    @property
    def local_collectives(self) -> bool:
        """Collectives the front end runs for its loop are local (catching up, or left)."""
        return self.catching_up or self.left

    @property
    def preparing(self) -> ParallelConfig | None:
        """The target of the world change being built ahead, if one is."""
        return self._ahead.choice.layout if self._ahead is not None else None

    @property
    def joining(self) -> bool:
        return self.header is not None and self.catching_up

    # ------------------------------------------------------------------------------ entering
    def enter(self, launch: "Launch") -> ParallelConfig | None:
        """Become a member, install this process's first world; the layout a joiner trains at
        (``None`` for a member of the first world: the front end's own)."""
        from lightning_dynatrain.elastic.client import JobStore

        self.launch = launch
        self.session = ElasticSession(JobStore.from_environment(), backend=launch.backend, device=launch.device,
                                      timeout=launch.timeout, heartbeat=self.heartbeat, exit_after=self.exit_after,
                                      keep_worlds=self.keep_worlds, recover=self.recover_from_loss)
        self.session.enter(self.fingerprint(), launch_rank=launch.rank, launch_size=launch.size,
                           launch_id=launch.launch_id if launch.size > 1 else self.session.me,
                           ends_with_launch=launch.ends_together and launch.size > 1,
                           world_sizes=None if self.policy == "auto" else tuple(sorted(self.policy)))
        self.front.joined(self.session)
        change = self.session.joined_change
        if change is None:  # the first world: one version directory for whoever is rank 0 later
            first = self.front.log_versions() if self.session.rank == 0 else None
            self.front.pin_log_versions(broadcast_object(first))
            return None
        self.catching_up = True
        self.header = broadcast_object(None)  # (1) from the new world's rank 0, an old member
        self.front.pin_log_versions(self.header["loggers"])
        self.front.info(f"[dynatrain] joined {change} at step {self.header['step']}")
        return ParallelConfig.parse(self.header["layout"])

    def join_state(self) -> None:
        """A joiner's state, then its loop's, from the old members (``joining.py`` (3)-(5)),
        installed on the run; from the front end's optimizer set-up."""
        self.run.install(receive_state(self, self.run.build_state))
        receive_trainer_state(self)

    @property
    def ahead(self) -> bool:
        """World changes are built ahead: asked for, and the model builds beside training (every member alike)."""
        recipe = self.run.recipe_or_none
        return self.ahead_requested and (recipe is None or recipe.model.builds_beside_training)

    def fingerprint(self) -> str:
        """What this process would train (the front end's ``job_description``), the packages, how world
        changes are made (a joiner must present the job's: every member takes part in every change's
        build alike)."""
        import importlib.metadata as md

        versions = [md.version(p) for p in ("torch", "megatron-core", "lightning")]
        try:
            versions.append(md.version("lightning-dynatrain"))
        except md.PackageNotFoundError:
            pass
        return job_fingerprint(*self.front.job_description(), versions,
                               {"ahead": self.ahead_requested, "keep_worlds": self.keep_worlds})

    @property
    def fills_model_later(self) -> bool:
        """A joiner whose peers build the target ahead: its model is built unfilled, with no
        collective (``megatron.model_source.build_unfilled``), as theirs."""
        return self.joining and bool(self.header and self.header["ahead"])

    def end_catching_up(self) -> None:
        if self.catching_up:
            self.catching_up = False
            self.header = None

    # -------------------------------------------------------------------------- every step
    def at_boundary(self) -> ChangeReport | None:
        """After optimizer step ``front.global_step``: publish it, make a change that is due."""
        assert self.session is not None
        step = self.front.global_step
        if self.left:
            return None
        self.session.publish_step(step)
        self._time_step(pending=self.detected_at is not None)
        try:
            change = self.session.poll(step)
        except Exception as err:  # the store's record came first (MemberLostError), or the vote's all-reduce
            recover_or_raise(self, err)
            return None
        pending = self.session.pending
        if self._ahead is not None and (pending is None or pending.generation != self._ahead.generation):
            self._ahead.drop()  # cancelled (a joiner died)
            self._ahead = None
        if change is None:
            if pending is not None and self.detected_at is None:
                self.detected_at = time.perf_counter()
            self._snapshot(step)
            return None
        if self.ahead:
            if self._ahead is None:
                self._prepare(change)
                self._snapshot(step)
                return None
            if not self._ahead.built_everywhere():
                self._snapshot(step)
                return None
        ahead, self._ahead = self._ahead, None
        if self.snapshots is not None:
            self.snapshots.before_state_change()
        report = change_world(self, change, ahead=ahead, detected=self.detected_at)
        if self.snapshots is not None:
            self.snapshots.after_state_change(step)
        self.detected_at, self.last_boundary = None, time.perf_counter()  # the pause is not a step
        slowdown = self._clock.slowdown()
        if report is not None:
            report.overlap_slowdown = slowdown
            if change.grows:  # (5) the joiners record the grow that admitted them, as the members do
                try:
                    broadcast_object(asdict(report) if self.session.rank == 0 else None)
                except Exception as err:  # a member died after the grow: recovered from in its world
                    recover_or_raise(self, err)
            self.history.append(report)
            self.front.info(str(report))
        return report

    def _snapshot(self, step: int) -> None:
        """A boundary where the state stays (every member of the world steps alike: no change or
        recovery made here): a snapshot is taken if one is due."""
        if self.snapshots is not None:
            self.snapshots.at_boundary(step)

    def _time_step(self, *, pending: bool) -> None:
        """Record the step that just ended, as overlapping a background build or not."""
        now = time.perf_counter()
        if self.last_boundary is not None:
            self._clock.add(now - self.last_boundary, overlapped=pending)
        self.last_boundary = now

    def choose(self, change: WorldChange) -> LayoutChoice:
        """The target layout for the new world (the same on every old member: a pure function)."""
        return self.choose_for(len(change.new.members), members=change.members)

    def choose_for(self, world: int, *, members: "Members") -> LayoutChoice:
        """The target layout for a world of ``world`` processes, the state held as ``members`` says."""
        from lightning_dynatrain.megatron.state_bridge import precision_of

        run = self.run
        recipe = run.recipe
        return choose_layout(self.policy, world=world, source=recipe.model,
                             global_batch_size=recipe.global_batch_size, micro_batch_size=recipe.micro_batch_size,
                             current=run.layout, precision=precision_of(run.state.model, run.state.optimizer),
                             members=members, memory_per_rank=self.memory_per_rank, model=self.step_model)

    # ------------------------------------------------------------------------------ failures
    def progress(self, step: int) -> StepProgress:
        """A record of the step that ends at global step ``step`` as it goes (read by a recovery)."""
        session = self.session
        return StepProgress(step=step, rank=dist.get_rank(), fault=self.step_fault,
                            before_update=self.snapshots.before_update if self.snapshots is not None else None,
                            stop_if_lost=session.raise_if_lost if session is not None and self.recover_from_loss
                            else None)

    def drop_ahead(self) -> None:
        """Forget a world change built ahead (its world will not come)."""
        if self._ahead is not None:
            self._ahead.drop()
            self._ahead = None

    def _prepare(self, change: WorldChange) -> None:
        """The first of a change built ahead's two boundaries (see ``ahead_change.py``)."""
        assert self.session is not None
        start = time.perf_counter()
        choice = self.choose(change)
        if not change.grows:  # a shrink's switch runs under the running world's watch: made now if it has none
            self.run.switcher.world_watch()
        borrowed = None if change.leaving else self.session.borrow()
        if change.grows:  # (1) for the joiners, waiting on the next world
            with borrowed:
                first = change.new.rank_of(change.me) == 0
                broadcast_object(join_header(self, choice.layout) if first else None)
        kept = self.session.pending_kept
        self._ahead = AheadChange.start(self.run, change, choice, borrowed, node_rank=self.node_rank,
                                        kept=kept.extra if kept is not None else None)
        self.front.info(f"[dynatrain] step {self.front.global_step}: {change}: building {choice.layout} ahead "
                        f"({time.perf_counter() - start:.3f} s for its groups)")

    @property
    def node_rank(self) -> int:
        """This process's node number (``Launch.node_rank``), for every world's topology."""
        assert self.launch is not None, "enter() first"
        return self.launch.node_rank

    def leave(self, step: int = -1) -> None:
        """Ask to leave the job at the boundary after optimizer step ``step`` (the state goes then)."""
        assert self.session is not None
        self.session.request_leave(step)

    def close(self, *, finished: bool = True) -> None:
        """The end of this process's part (``finished``: its fit ended or it left; otherwise it stops
        on an error and the job's store records it failed at once)."""
        if self.snapshots is not None:
            self.snapshots.close()
        if self._ahead is not None and finished:  # a change pending at the end: its build ends before the process
            self._ahead.close()
            self._ahead = None
        if self.session is not None:
            self.session.close(finished=finished)


__all__ = ["ElasticDriver"]
