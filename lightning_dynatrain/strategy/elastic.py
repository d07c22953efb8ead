"""World changes inside a running ``trainer.fit``: the strategy's side of the Elastic Device Manager.

``ElasticDriver`` (one per strategy, made when an ``OnNodeChange`` callback is present) holds this
process's ``elastic.ElasticSession`` and does the Lightning and megatron work of a change:

**Entering** (``enter``, from ``setup_environment``): every process asks the job's store to join;
the ones a launcher started together form the first world, a process started later joins the
running job and takes part in the new world's first collectives (``strategy/joining.py``).

**Leaving**: a process asked to leave (SIGTERM, SIGUSR1, ``leave()``) keeps training until the
change's boundary, sends its state over the old world (``hot_switch.send_state``), stops its fit
(``trainer.should_stop``) with every later collective local, and exits 0. The survivors install
their new world before the transfer and build the target there.

Example (what ``OnNodeChange`` does at each boundary)::

    driver.at_boundary(trainer)      # one store read; a change when one is due
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dynatrain.elastic.policy import LayoutChoice, StepModel, choose_layout, parse_policy
from lightning_dynatrain.elastic.records import job_fingerprint
from lightning_dynatrain.elastic.failure_watch import MemberFailedError, MemberLostError, is_communication_failure
from lightning_dynatrain.elastic.session import ElasticSession, WorldChange
from lightning_dynatrain.megatron.step_progress import StepFault, StepProgress
from lightning_dynatrain.strategy.change_report import ChangeReport
from lightning_dynatrain.strategy.elastic_environment import ElasticEnvironment, LauncherError, launch_id, set_rank_zero
from lightning_dynatrain.strategy.joining import join_header
from lightning_dynatrain.strategy.loggers import logger_versions, pin_logger_versions
from lightning_dynatrain.strategy.elastic_ahead import AheadChange
from lightning_dynatrain.strategy.snapshot_recovery import SnapshotKeeper
from lightning_dynatrain.strategy.step_clock import OverlapClock
from lightning_dynatrain.strategy.world_change import broadcast_object, change_world
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dynatrain.elastic.records import Membership
    from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy
    from lightning_dynatrain.strategy.recovery import Recovered, RecoveryReport
    from lightning_dynatrain.vps.members import Members

#: recoveries tried in a row when members keep dying during one (each agrees on a world without them)
MAX_RECOVERY_ATTEMPTS = 3


class ElasticDriver:
    """The strategy's elastic side (see the module docstring)."""

    def __init__(self, strategy: "DynaTrainStrategy", *, policy: Any, memory_per_rank: int | None = None,
                 step_model: StepModel = StepModel(), heartbeat: float = 1.0, exit_after: float = 30.0,
                 ahead: bool = True, keep_worlds: int = 2, recover: bool = True,
                 snapshot_every: int | None = None, snapshot_buffers: int = 1) -> None:
        self.strategy = strategy
        self.recover_from_loss = recover
        self.snapshots = SnapshotKeeper(snapshot_every, buffers=snapshot_buffers) if snapshot_every else None
        """In-memory snapshots and the step log (``strategy/snapshot_recovery.py``), or ``None``."""
        self.recoveries: list[RecoveryReport] = []
        """Every recovery from a member lost without leaving (``strategy/recovery.py``)."""
        self._step_fault = StepFault.from_environment()  # test hook (megatron.step_progress)
        self.last_loss: tuple[int, float] | None = None
        """The last step this process completed and its loss (a recovery hands it to a survivor
        whose own reduction of that loss failed)."""
        self.ahead_requested, self.keep_worlds = ahead, keep_worlds
        self.policy = parse_policy(policy)
        self.memory_per_rank, self.step_model = memory_per_rank, step_model
        self.heartbeat, self.exit_after = heartbeat, exit_after
        self.session: ElasticSession | None = None
        self.header: dict[str, Any] | None = None
        self.catching_up = False
        self.left = False
        self.history: list[ChangeReport] = []
        self.admitted_by: ChangeReport | None = None
        """A joiner's: the grow that admitted it (rank 0's report, ``receive_trainer_state``)."""
        self._detected_at: float | None = None
        self._last_boundary: float | None = None
        self._clock = OverlapClock()  # step seconds, with and without a change pending
        self._ahead: AheadChange | None = None  # the pending change, built ahead (strategy/elastic_ahead.py)
        self.rolled_back: list[dict[str, Any]] = []
        """World changes that failed with the old state whole and went back to the old world
        (``world_change.go_back``)."""

    @property
    def local_collectives(self) -> bool:
        """Collectives the strategy runs for Lightning are local (catching up, or left)."""
        return self.catching_up or self.left

    @property
    def preparing(self) -> ParallelConfig | None:
        """The target of the world change being built ahead, if one is."""
        return self._ahead.choice.layout if self._ahead is not None else None

    @property
    def joining(self) -> bool:
        return self.header is not None and self.catching_up

    # ------------------------------------------------------------------------------ entering
    def enter(self, launcher: ClusterEnvironment) -> ParallelConfig | None:
        """Become a member, install this process's first world; the layout a joiner trains at
        (``None`` for a member of the first world: the strategy's own)."""
        from lightning_dynatrain.elastic.client import JobStore

        strategy = self.strategy
        launcher_world = launcher.world_size()
        if not launcher.creates_processes_externally and launcher_world > 1:
            raise LauncherError(
                "elastic training (OnNodeChange) cannot run under Lightning's own launcher with more than one "
                "process: rank 0 is the parent of every other rank and ends them all when one exits",
                hint="launch with torchrun or srun (or one process per `python train.py`), with DYNATRAIN_STORE "
                "and DYNATRAIN_TOKEN set; start the store with `dynatrain store`")
        device = strategy.root_device if strategy.root_device.type == "cuda" else None
        self.session = ElasticSession(JobStore.from_environment(), backend=strategy.process_group_backend,
                                      device=device, timeout=strategy._timeout, heartbeat=self.heartbeat,
                                      exit_after=self.exit_after, keep_worlds=self.keep_worlds,
                                      recover=self.recover_from_loss)
        self.session.enter(self.fingerprint(), launch_rank=launcher.global_rank(), launch_size=launcher_world,
                           launch_id=launch_id(launcher, self.session.me))
        strategy.cluster_environment = ElasticEnvironment(launcher, self.session)
        set_rank_zero(self.session.rank)
        loggers = self._loggers()
        change = self.session.joined_change
        if change is None:  # the first world: one version directory for whoever is rank 0 later
            pin_logger_versions(loggers, broadcast_object(logger_versions(loggers) if self.session.rank == 0 else None))
            return None
        self.catching_up = True
        self.header = broadcast_object(None)  # (1) from the new world's rank 0, an old member
        pin_logger_versions(loggers, self.header["loggers"])
        rank_zero_info(f"[dynatrain] joined {change} at step {self.header['step']}")
        return ParallelConfig.parse(self.header["layout"])

    @property
    def ahead(self) -> bool:
        """World changes are built ahead: asked for, and the model builds beside training (every member alike)."""
        recipe = self.strategy._recipe
        return self.ahead_requested and (recipe is None or recipe.model.builds_beside_training)

    def _loggers(self) -> list:
        trainer = self.strategy._trainer()
        return list(trainer.loggers) if trainer is not None else []

    def fingerprint(self) -> str:
        """What this process would train: the module's class, recipe and optimizer settings, the
        precision, the packages, how world changes are made (a joiner must present the job's: every
        member takes part in every change's build alike)."""
        import importlib.metadata as md

        module = self.strategy.lightning_module
        versions = [md.version(p) for p in ("torch", "megatron-core", "lightning")]
        try:
            versions.append(md.version("lightning-dynatrain"))
        except md.PackageNotFoundError:
            pass
        recipe = getattr(module, "recipe", None)
        adam = module.configure_optimizers() if module is not None else None
        hparams = dict(getattr(module, "hparams", {}) or {})
        return job_fingerprint(type(module).__qualname__, recipe, adam, sorted(hparams.items()),
                               type(self.strategy.precision_plugin).__name__,
                               getattr(self.strategy.precision_plugin, "precision", None), versions,
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
    def at_boundary(self, trainer: "pl.Trainer") -> ChangeReport | None:
        """After optimizer step ``trainer.global_step``: publish it, make a change that is due."""
        assert self.session is not None
        step = trainer.global_step
        if self.left:
            return None
        self.session.publish_step(step)
        self._time_step(pending=self._detected_at is not None)
        try:
            change = self.session.poll(step)
        except MemberLostError as lost:  # the store's record came before any collective failed here
            self.recover(trainer, record=lost.record)
            return None
        except Exception as err:  # the vote's all-reduce, with a member gone
            self.recover_or_raise(trainer, err)
            return None
        pending = self.session.pending
        if self._ahead is not None and (pending is None or pending.generation != self._ahead.generation):
            self._ahead.drop()  # cancelled (a joiner died)
            self._ahead = None
        if change is None:
            if pending is not None and self._detected_at is None:
                self._detected_at = time.perf_counter()
            self._snapshot(step)
            return None
        if self.ahead:
            if self._ahead is None:
                self._prepare(change, trainer)
                self._snapshot(step)
                return None
            if not self._ahead.built_everywhere():
                self._snapshot(step)
                return None
        ahead, self._ahead = self._ahead, None
        if self.snapshots is not None:
            self.snapshots.before_state_change()
        report = change_world(self, change, trainer, ahead=ahead, detected=self._detected_at)
        if self.snapshots is not None:
            self.snapshots.after_state_change(step)
        self._detected_at, self._last_boundary = None, time.perf_counter()  # the pause is not a step
        slowdown = self._clock.slowdown()
        if report is not None:
            report.overlap_slowdown = slowdown
            if change.grows:  # (5) the joiners record the grow that admitted them, as the members do
                try:
                    broadcast_object(asdict(report) if self.session.rank == 0 else None)
                except Exception as err:  # a member died after the grow: recovered from in its world
                    self.recover_or_raise(trainer, err)
            self.history.append(report)
            rank_zero_info(str(report))
        return report

    def _snapshot(self, step: int) -> None:
        """A boundary where the state stays (every member of the world steps alike: no change or
        recovery made here): a snapshot is taken if one is due."""
        if self.snapshots is not None:
            self.snapshots.at_boundary(self.strategy, step)

    def _time_step(self, *, pending: bool) -> None:
        """Record the step that just ended, as overlapping a background build or not."""
        now = time.perf_counter()
        if self._last_boundary is not None:
            self._clock.add(now - self._last_boundary, overlapped=pending)
        self._last_boundary = now

    def choose(self, change: WorldChange) -> LayoutChoice:
        """The target layout for the new world (the same on every old member: a pure function)."""
        return self.choose_for(len(change.new.members), members=change.members)

    def choose_for(self, world: int, *, members: "Members") -> LayoutChoice:
        """The target layout for a world of ``world`` processes, the state held as ``members`` says."""
        from lightning_dynatrain.megatron.state_bridge import precision_of

        strategy = self.strategy
        recipe = strategy.recipe
        return choose_layout(self.policy, world=world, source=recipe.model,
                             global_batch_size=recipe.global_batch_size, micro_batch_size=recipe.micro_batch_size,
                             current=strategy.layout,
                             precision=precision_of(strategy.megatron.model, strategy.megatron.optimizer),
                             members=members, memory_per_rank=self.memory_per_rank, model=self.step_model)

    # ------------------------------------------------------------------------------ failures
    def progress(self, step: int) -> StepProgress:
        """A record of the step that ends at global step ``step`` as it goes (read by ``recover``)."""
        return StepProgress(step=step, rank=self.strategy.global_rank, fault=self._step_fault,
                            before_update=self.snapshots.before_update if self.snapshots is not None else None)

    def recovers(self, err: BaseException) -> bool:
        """``err`` is a collective that failed, or a switch a rank went missing in, and the survivors
        go on after it (``recover``): from the state they hold, or, where the switch freed some of it
        as it moved it (``SwitchFailedError.freed``), from the in-memory snapshot (if any)."""
        from lightning_dynatrain.engine.errors import SwitchFailedError

        if not self.recover_from_loss or self.session is None or self.left:
            return False
        if isinstance(err, SwitchFailedError):
            return (not err.freed or self.snapshots is not None) and \
                (err.rank is not None or is_communication_failure(err))
        return is_communication_failure(err)

    def recover_or_raise(self, trainer: "pl.Trainer", err: BaseException) -> None:
        """Called where ``err`` was caught at a boundary: the survivors go on (``recover``) if
        ``recovers(err)``, else ``err`` is raised again."""
        if not self.recovers(err):
            raise err
        self.recover(trainer, error=err)

    def recover(self, trainer: "pl.Trainer", *, error: BaseException | None = None,
                record: "Membership | None" = None, progress: StepProgress | None = None,
                state_world: "Membership | None" = None, retired: tuple | None = None,
                was_rank_zero: bool = False) -> Recovered:
        """Go on in the survivors' world (``strategy/recovery.py``); what the step in flight does next.
        ``state_world``: the world whose ranks hold the state, when not the running one (a shrink's
        switch failed); with ``retired`` (that world's caches and groups), the running world lost
        nobody and only the state is rebuilt (``recovery.recover_in_world``)."""
        from lightning_dynatrain.strategy.recovery import recover, recover_in_world

        self._detected_at, self._step_fault = None, None  # (a test's fault fires in the first world only)
        assert self.session is not None and self.session.world is not None
        state_world = state_world or self.session.world
        was_rank_zero = was_rank_zero or self.strategy.global_rank == 0
        noticed = time.perf_counter()  # (the figures span every attempt)
        for attempt in range(1, MAX_RECOVERY_ATTEMPTS + 1):
            try:
                if retired is not None:
                    assert error is not None
                    outcome = recover_in_world(self, trainer, error=error, state_world=state_world, retired=retired,
                                               was_rank_zero=was_rank_zero, noticed=noticed)
                else:
                    outcome = recover(self, trainer, error=error, record=record, progress=progress,
                                      state_world=state_world, was_rank_zero=was_rank_zero, noticed=noticed)
                break
            except Exception as err:  # another member died before the state moved: again, without it too
                lost = isinstance(err, MemberLostError)  # (the store recorded it while the world was built)
                if attempt == MAX_RECOVERY_ATTEMPTS or isinstance(err, MemberFailedError) or \
                        not (lost or self.recovers(err)):
                    raise  # (MemberFailedError: the recovery itself found the job cannot go on)
                rank_zero_warn(f"[dynatrain] a member died during the recovery ({type(err).__name__}: {err}); "
                               "the survivors agree on a world without it too")
                freed = getattr(error, "freed", False)  # (a state freed stays freed: the snapshot or nothing)
                if lost:
                    record, retired = err.record, None
                else:
                    error, record, retired = error if freed else err, None, None
        self.recoveries.append(outcome.report)
        self._last_boundary = time.perf_counter()  # the pause is not a step
        return outcome

    def drop_ahead(self) -> None:
        """Forget a world change built ahead (its world will not come)."""
        if self._ahead is not None:
            self._ahead.drop()
            self._ahead = None

    def _prepare(self, change: WorldChange, trainer: "pl.Trainer") -> None:
        """The first of a change built ahead's two boundaries (see ``strategy/elastic_ahead.py``)."""
        assert self.session is not None
        start = time.perf_counter()
        choice = self.choose(change)
        if not change.grows:  # a shrink's switch runs under the running world's watch: made now if it has none
            self.strategy.switcher.world_watch()
        borrowed = None if change.leaving else self.session.borrow()
        if change.grows:  # (1) for the joiners, waiting on the next world
            with borrowed:
                first = change.new.rank_of(change.me) == 0
                broadcast_object(join_header(self, trainer, choice.layout) if first else None)
        kept = self.session.pending_kept
        self._ahead = AheadChange.start(self.strategy, change, choice, borrowed,
                                        kept=kept.extra if kept is not None else None)
        rank_zero_info(f"[dynatrain] step {trainer.global_step}: {change}: building {choice.layout} ahead "
                       f"({time.perf_counter() - start:.3f} s for its groups)")

    def leave(self, step: int = -1) -> None:
        """Ask to leave the job at the boundary after optimizer step ``step`` (the state goes then)."""
        assert self.session is not None
        self.session.request_leave(step)

    def close(self) -> None:
        if self.snapshots is not None:
            self.snapshots.close()
        if self.session is not None:
            self.session.close()


__all__ = ["ChangeReport", "ElasticDriver", "ElasticEnvironment", "LauncherError"]
