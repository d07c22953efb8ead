"""``OnNodeChange``: processes join and leave a running ``trainer.fit``; the layout follows the world.

With this callback the strategy is elastic: every process enters the job through its store (set
``DYNATRAIN_STORE=host:port`` and ``DYNATRAIN_TOKEN``; start the store with ``dynatrain store``).
The processes a launcher starts together form the first world. The same script started later
(``torchrun``, ``srun`` of a new step, or one ``python train.py``) joins the running fit at the
current step. A process that gets SIGTERM (or SLURM's SIGUSR1 warning) leaves: it hands its state
off at the next change boundary and exits 0; but a torchrun worker whose launch lost a worker ends
at once with it (torchrun's agent stops the launch: ``elastic/launch_teardown.py``). A process
that dies without leaving (SIGKILL, a lost node) is named by the store within seconds; the
survivors rebuild the state from the replicas they hold, or an in-memory snapshot
(``snapshot_every``), and go on (``recover``; ``elastic/driver/recovery.py``). The work of every
change is the elastic driver's (``elastic.driver.ElasticDriver``, Lightning-free); this callback
makes it for the strategy, hands it each step boundary and logs what it did. At each change ``policy`` picks the new
world's layout.

Example::

    trainer = Trainer(strategy=DynaTrainStrategy("dp2-tp1-pp1"), devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                      callbacks=[OnNodeChange({2: "dp2-tp1-pp1", 3: "dp3-tp1-pp1", 4: "dp2-tp2-pp1"})])

    DYNATRAIN_STORE=node1:29400 DYNATRAIN_TOKEN=... torchrun --nproc-per-node 2 train.py   # the job
    DYNATRAIN_STORE=node1:29400 DYNATRAIN_TOKEN=... torchrun --nproc-per-node 2 train.py   # later: 2 join

Each change is logged (``[dynatrain] step N: world 2 -> 4 ...``, and the metrics
``dynatrain/world_size``, ``dynatrain/change_pause_seconds``, ``dynatrain/change_transfer_seconds``,
``dynatrain/change_build_seconds``, ``dynatrain/change_moved_bytes``, and
``dynatrain/change_overlap_slowdown``: how much slower the steps run while the next world was built
were than the steps before) and kept in ``changes``. Each recovery is logged too (``[dynatrain] step
N: member(s) ... lost; world 4 -> 3 ...``, the metrics ``dynatrain/recovery_pause_seconds`` and
``dynatrain/recovery_steps_redone``) and kept in ``recoveries``; each in-memory snapshot logs
``dynatrain/snapshot_copy_seconds`` (this rank's own copy, beside the next step),
``dynatrain/snapshot_exchange_seconds`` and ``dynatrain/snapshot_host_bytes``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dynatrain.compat.lightning_internals import log_this_step
from lightning_dynatrain.elastic.driver.front import ElasticCallback
from lightning_dynatrain.elastic.driver.layout_policy import Policy, StepModel
from lightning_dynatrain.elastic.driver.leave_notice import LeaveNotice
from lightning_dynatrain.elastic.driver.options import ElasticOptions
from lightning_dynatrain.elastic.session import MemberFailedError

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dynatrain.elastic.driver.driver import ElasticDriver
    from lightning_dynatrain.elastic.driver.front import TrainingFront
    from lightning_dynatrain.runtime.training_run import TrainingRun

class OnNodeChange(Callback, ElasticCallback):
    """Make the fit elastic and pick the layout of every new world.

    Args:
        policy: ``"auto"`` (the best modelled throughput among valid layouts; see
            ``elastic.driver.layout_policy``), a map ``{world size: layout}``, or a YAML file holding one.
        memory_per_rank: ``auto`` keeps only layouts whose state takes at most this many bytes a rank.
        step_model: the hardware ``auto`` ranks layouts for.
        heartbeat: seconds between this process's liveness stamps in the store.
        exit_after: seconds a process waits, once the store reports a member failed, before it ends
            itself (it is then stuck in a collective that cannot complete).
        ahead: build the next world's megatron groups and the target's model, DDP and optimizer in
            the background while the old world trains (one step boundary later than on demand),
            so that the change's pause is the transfer; ``False`` builds them in the pause.
        keep_worlds: how many worlds left for a larger one are kept (their process groups, megatron's
            included) for a return to the same processes, which then builds no group (a shrink that
            gives borrowed processes back). On NCCL each kept world holds its communicators' memory;
            0 keeps none.
        recover: when a member dies without leaving, the survivors go on in a world of their own, from
            the state their replicas hold (the step in flight is redone at the new layout, or counts
            as done where its result survived). Where the dead held the only copy of some state
            (ZeRO-1 shards, tp/pp shards at dp1) the job ends with ``MemberFailedError`` naming it,
            unless ``snapshot_every`` is set. ``False``: any death ends the job.
        snapshot_every: keep an in-memory snapshot of the state every this many steps: each rank's
            own state in host memory, and the state only its failure domain holds (node; on one
            node, process) also on a rank of another, copied in a background thread while the next
            step computes. A death that takes state no survivor holds then goes back to the newest
            snapshot, and the steps since run again at the survivors' layout on the same batches with
            the same learning rates (at most ``snapshot_every``; ``dynatrain/recovery_steps_redone``).
            Costs host memory of one copy of a rank's state plus what it keeps for its peer, and a
            copy of the step's global batches. ``None`` (default): no snapshots.
        snapshot_buffers: 1 (default): each snapshot overwrites the last in place, so a death while
            one is being taken (its boundary to the end of its exchange, part of the next step) finds
            no whole snapshot; 2: snapshots alternate between two buffers, the previous one stays
            whole meanwhile and a death then goes back to it (up to ``snapshot_every + 1`` steps
            redone), for twice the host memory.

    Raises:
        LayoutError: (at construction) the policy cannot be read; (at a change) it has no valid
            layout for the new world.
        LauncherError, AdmissionError: (at start) the launcher or the store cannot carry the job.
        MemberFailedError: a member stopped without leaving and the survivors cannot go on (state
            lost, ``recover=False``, or a collective failed outside a step); the message names it.
        SwitchFailedError: a world change's switch lost a process and the state of the step (a
            shrink, or a grow under ``switch_safety="fast"`` once state moved). A grow that fails
            with the old state whole goes back to the old world instead, with a warning, and
            training goes on (``rolled_back``).
    """

    def __init__(self, policy: Policy = "auto", *, memory_per_rank: int | None = None,
                 step_model: StepModel = StepModel(), heartbeat: float = 1.0, exit_after: float = 30.0,
                 ahead: bool = True, keep_worlds: int = 2, recover: bool = True,
                 snapshot_every: int | None = None, snapshot_buffers: int = 1) -> None:
        #: the options, checked (``elastic.driver.options.ElasticOptions``, what the Fabric engine takes too)
        self.options = ElasticOptions(policy, memory_per_rank=memory_per_rank, step_model=step_model,
                                      heartbeat=heartbeat, exit_after=exit_after, ahead=ahead, keep_worlds=keep_worlds,
                                      recover=recover, snapshot_every=snapshot_every, snapshot_buffers=snapshot_buffers)
        #: every world change of the job, in order: a joiner gets rank 0's list with Lightning's state and
        #: adds the grow that admitted it, so every process holds the same history
        self.changes: list[dict[str, Any]] = []
        #: the world changes that failed with the old state whole and were rolled back: a grow whose
        #: joiner went missing (under ``switch_safety="keep_old"``, or before anything moved)
        self.rolled_back: list[dict[str, Any]] = []
        #: every recovery from members lost without leaving (``RecoveryReport`` as a dict)
        self.recoveries: list[dict[str, Any]] = []
        self._recoveries_logged = 0
        self._snapshot_logged: int | None = None
        self._driver: ElasticDriver | None = None
        self._leave_notice = LeaveNotice()
        self._wrapped_connector: Any = None  # Lightning's signal connector, while its handler registration is wrapped

    def make_driver(self, run: "TrainingRun", front: "TrainingFront") -> "ElasticDriver":
        """The run's elastic side (called by the strategy when it sets up: ``ElasticCallback``)."""
        self._leave_notice.listen()  # from before this process enters the job: a notice during its set-up counts
        self._driver = self.options.driver(run, front)
        return self._driver

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy

        if not isinstance(trainer.strategy, DynaTrainStrategy) or self._driver is None:
            raise TypeError("OnNodeChange needs Trainer(strategy=DynaTrainStrategy(...)): it changes the world "
                            f"under that strategy, not under {type(trainer.strategy).__name__}")
        # Lightning registers its SIGTERM handler just before the fit loop starts, and that handler
        # broadcasts over the world from inside itself: a leave notice between then and
        # on_train_start would hang this process. Ours goes back in right after Lightning's.
        from lightning_dynatrain.compat.lightning_internals import signal_connector

        connector = signal_connector(trainer)
        register = connector.register_signal_handlers

        def register_then_listen() -> None:
            register()
            self._leave_notice.listen()  # (Lightning's SIGTERM handler broadcasts from inside itself)

        connector.register_signal_handlers = register_then_listen
        self._wrapped_connector = connector

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A joiner's history is rank 0's (restored with Lightning's state) and the grow that admitted it."""
        if self._driver is not None and self._driver.admitted_by is not None:
            self.changes.append(asdict(self._driver.admitted_by))

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self._driver is not None
        if self._leave_notice.take():
            self._driver.leave(trainer.global_step)
        seen = len(self._driver.rolled_back)
        try:
            report = self._driver.at_boundary()
        except BaseException:  # the fit ends here, before the loop would log this step
            log_this_step(trainer)
            raise
        self.rolled_back += self._driver.rolled_back[seen:]
        for recovery in self._driver.recoveries[self._recoveries_logged:]:  # in this step or at this boundary
            self._recoveries_logged += 1
            self.recoveries.append(asdict(recovery))
            pl_module.log_dict({"dynatrain/world_size": float(trainer.world_size),
                                "dynatrain/recovery_pause_seconds": recovery.pause_seconds,
                                "dynatrain/recovery_steps_redone": float(recovery.steps_redone)},
                               on_step=True, on_epoch=False, batch_size=1)
        figures = self._driver.snapshots.figures if self._driver.snapshots is not None else None
        if figures is not None and figures.step != self._snapshot_logged:  # a snapshot ended since
            self._snapshot_logged = figures.step
            pl_module.log_dict({"dynatrain/snapshot_copy_seconds": figures.copy_seconds,
                                "dynatrain/snapshot_exchange_seconds": figures.exchange_seconds,
                                "dynatrain/snapshot_host_bytes": float(figures.host_bytes)},
                               on_step=True, on_epoch=False, batch_size=1)
        if report is not None:
            self.changes.append(asdict(report))
            metrics = {"dynatrain/world_size": float(trainer.world_size),
                       "dynatrain/change_pause_seconds": report.pause_seconds,
                       "dynatrain/change_transfer_seconds": report.transfer_seconds,
                       "dynatrain/change_build_seconds": report.build_seconds,
                       "dynatrain/change_moved_bytes": float(report.moved_bytes)}
            if report.overlap_slowdown is not None:
                metrics["dynatrain/change_overlap_slowdown"] = report.overlap_slowdown
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        """A collective failed: when a member failed, say so (the store's account, within its
        liveness bound) instead of the transport's message. A ``SwitchFailedError`` (a world
        change's grow runs under the switch watch) names the rank and the phase already."""
        from lightning_dynatrain.transition.errors import SwitchFailedError

        if isinstance(exception, (MemberFailedError, SwitchFailedError)) or self._driver is None \
                or self._driver.session is None:
            return
        failure = self._driver.session.wait_for_failure(timeout=3 * self.options.heartbeat + 15.0,
                                                         cause=f"{type(exception).__name__}: {exception}")
        if failure is not None:
            raise MemberFailedError(failure, hint="see the failed process's log; restart the job from its last "
                                    "checkpoint") from exception

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._leave_notice.restore()
        if self._wrapped_connector is not None:  # Lightning's own method again
            self._wrapped_connector.__dict__.pop("register_signal_handlers", None)
            self._wrapped_connector = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"changes": list(self.changes), "rolled_back": list(self.rolled_back),
                "recoveries": list(self.recoveries)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.changes = list(state_dict.get("changes", []))
        self.rolled_back = list(state_dict.get("rolled_back", []))
        self.recoveries = list(state_dict.get("recoveries", []))


__all__ = ["OnNodeChange"]
