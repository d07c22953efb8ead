"""``DynaTrainEngine``: a megatron-core model trained step by step in a plain loop, switching layout.

The engine runs on the processes and default process group a loop library made: Accelerate
(``lightning_dynatrain.accelerate.DynaTrainEngine(accelerator, plugin, ...)``) or Lightning Fabric
(``lightning_dynatrain.fabric.DynaTrainEngine(fabric, ...)`` under ``DynaTrainFabricStrategy``).
What it takes from that library goes through one small interface, ``library.LoopLibrary``. It is
the loop counterpart of ``DynaTrainStrategy`` over the same training core:

- the run: ``runtime.training_run.TrainingRun`` (groups, the model shard checked against its
  description, DDP and optimizer; the one check of a switch request; the switch; the step: this
  rank's data-parallel share of the global batch, the step's learning rate, megatron's pipeline
  schedule, in one call, so pipeline stages need nothing from the loop);
- the settings: ``runtime.settings.DynaTrainSettings`` (Accelerate's ``DynaTrainPlugin`` is one);
- the schedule: ``runtime.switch_schedule.SwitchSchedule``, the driver ``ScheduledReconfig`` uses too.

When a switch runs: ``reconfigure(target)`` at once (call it between steps, on every rank); a
schedule entry ``S: L`` of the settings once ``S`` optimizer steps are done, at the first step
boundary after that (``optimizer.step()`` of the loop, else the start of the next step). Rank 0 of
each node prints one line per switch (the library's ``print``)::

    [dynatrain] step 2: dp2-tp2-pp1 -> dp1-tp2-pp2 in 0.412 s, moved 12.0 MiB (...), retained 30.1 MiB (...)

The loss each step returns is the global batch's mean token loss, already reduced over the
data-parallel ranks and sent from the last pipeline stage: the same float on every rank, so it
needs no further reduction (``accelerator.gather_for_metrics`` or ``fabric.all_gather`` over it
returns one equal copy per process).

Elastic (the library's ``elastic`` options: ``DynaTrainFabricStrategy(elastic=ElasticOptions(...))``):
the engine enters the job through its store as it is built (a process that joins a running job
receives the state and the engine's progress there), runs each step, layout switch and rollout
phase under the recovery guard (``elastic.driver.recovery``: a member lost in them is recovered
from and the survivors go on), and hands each step boundary to the elastic driver, which makes a
change that is due. A process asked to leave (SIGTERM, SIGUSR1) hands its state off at a boundary
and sets ``should_stop``: the loop ends there (``train_step`` refuses to run on). The driver
reaches the engine through ``elastic_front.LoopFront``; ``docs/elastic.md``.

The learning rate of step ``k`` (0-based) is ``lr_at(k)``: a function of the step count, so it
survives switches and resumes untouched, as under the Lightning strategy. Weight decay is the
optimizer settings' ``weight_decay``, applied the way megatron's scheduler does (``set_lr_and_wd``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_dynatrain.elastic.driver.leave_notice import LeaveNotice
from lightning_dynatrain.elastic.driver.recovery import rollout_recovering, step_recovering, switch_recovering
from lightning_dynatrain.loop.gather import every_rank
from lightning_dynatrain.loop.library import LoopLibrary, as_library, elastic_options
from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe, optimizer_config
from lightning_dynatrain.runtime.reconfig_report import ReconfigReport
from lightning_dynatrain.runtime.settings import DynaTrainSettings
from lightning_dynatrain.runtime.switch_schedule import SwitchSchedule
from lightning_dynatrain.runtime.training_run import TrainingRun
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig
    from torch.utils.data import Dataset

    from lightning_dynatrain.data.datamodule import GlobalBatchDataLoader
    from lightning_dynatrain.data.sampler import GlobalBatchSampler
    from lightning_dynatrain.elastic.driver.driver import ElasticDriver
    from lightning_dynatrain.elastic.driver.options import ElasticOptions
    from lightning_dynatrain.megatron.state import MegatronState


class DataMismatchError(DynaTrainError):
    """The ranks were handed different batches for the same step."""


class LoopSetupError(DynaTrainError):
    """The loop library (or how it was launched) is set up in a way the megatron step cannot use."""


class DynaTrainEngine:
    """The run at its current layout, its steps, its switches (see the module docstring).

    Collective: every rank builds it with the same arguments, and calls ``train_step`` and
    ``reconfigure`` in the same order.

    Args:
        library: the ``LoopLibrary`` it runs in (the ``DynaTrainEngine`` of ``lightning_dynatrain.accelerate``
            and ``lightning_dynatrain.fabric`` take an ``Accelerator`` or a launched ``Fabric`` instead):
            its processes, default process group, device and precision are used.
        settings: the layout, the switch schedule and budgets (``DynaTrainSettings``; Accelerate's
            ``DynaTrainPlugin`` is one). Where the library holds them (Fabric's strategy) leave this
            ``None``; else ``None`` reads ``DYNATRAIN_*`` variables (``DynaTrainSettings.from_environment``).
        recipe: the layout-free model (the GPT preset's ``GPTShape`` or a ``ModelProvider``) and the
            batch sizes; ``params_dtype`` follows the library's precision (leave it ``None``).
        optimizer: megatron's ``OptimizerConfig`` (Adam or SGD; ``lr`` the peak rate) or
            ``AdamSettings``.
        adam: ``AdamSettings``, the same as ``optimizer=`` (give one of the two).
        lr_at: learning rate of optimizer step ``k`` (0-based); default the constant ``lr``.

    Raises:
        AcceleratorSetupError / FabricSetupError: the library cannot run the megatron step (no process
            group, a sharding engine of its own, gradient accumulation, fp16, ...).
        LoopSetupError: the recipe's dtype disagrees with the library's precision, settings were given
            where the library holds them, or not exactly one of ``optimizer`` and ``adam``.
        LayoutError / WorldSizeError / BatchSizeError / ScheduleError: the starting layout or a
            schedule entry does not fit the world, the model or the batch sizes.

    Attributes:
        model, optimizer, scheduler: what the loop hands to ``accelerator.prepare`` or
            ``fabric.setup`` (``prepared.py``), which keep them from wrapping and sharding.
        run: the ``TrainingRun`` it drives.
        history: every switch that moved state, in order (the same on every rank).
    """

    def __init__(self, library: Any, settings: "DynaTrainSettings | None" = None, *, recipe: MegatronRecipe,
                 optimizer: "AdamSettings | OptimizerConfig | None" = None, adam: AdamSettings | None = None,
                 lr_at: Callable[[int], float] | None = None) -> None:
        from lightning_dynatrain.loop.prepared import DynaTrainModel, DynaTrainScheduler, LoopOptimizer

        if (optimizer is None) == (adam is None):
            raise LoopSetupError("DynaTrainEngine takes the optimizer's settings once: " + (
                "neither optimizer= nor adam= was given" if optimizer is None else "both optimizer= and adam="),
                hint="pass optimizer=OptimizerConfig(optimizer='adam', lr=...) (or AdamSettings)")

        self.library: LoopLibrary = as_library(library)
        dtype = self.library.params_dtype
        if recipe.params_dtype not in (None, dtype):
            raise LoopSetupError(
                f"MegatronRecipe(params_dtype={recipe.params_dtype}) disagrees with the {self.library.name} "
                f"precision ({dtype})", hint=f"leave params_dtype=None: the {self.library.name} precision says it")
        self.settings = _settings_of(self.library, settings)
        optimizer_settings = optimizer if optimizer is not None else adam
        self._optimizer_settings = optimizer_settings
        config = optimizer_config(optimizer_settings)
        self.weight_decay = config.weight_decay
        self.recipe = replace(recipe, params_dtype=dtype)
        self.lr_at: Callable[[int], float] = lr_at if lr_at is not None else _Constant(config.lr)
        self.schedule = SwitchSchedule(self.settings.schedule, on_refused=self.settings.on_refused,
                                       ahead=self.settings.schedule_ahead)
        #: the checkpoint folder last saved or loaded (a failed switch names it to resume from), else None
        self.last_checkpoint: str | None = None
        #: optimizer steps done
        self.step = 0
        #: the step of the checkpoint last loaded into the state (``loop.checkpoint``), else None
        self.loaded_step: int | None = None
        self.history: list[ReconfigReport] = []
        self._samplers: list[GlobalBatchSampler] = []
        self._data_checked = False
        #: this process left an elastic job (its loop ends: ``train_step`` refuses to run)
        self.should_stop = False
        self.run = TrainingRun(self.settings, resume_from=lambda: self.last_checkpoint, warn=self._say)
        #: the elastic driver (an ``ElasticLoopLibrary`` with options: Fabric's ``DynaTrainFabricStrategy(elastic=...)``)
        self.elastic: ElasticDriver | None = None
        self._leave_notice: LeaveNotice | None = None
        options = elastic_options(self.library)
        layout = self._enter_job(options) if options is not None else None
        if layout is None:
            layout = self.settings.validate(world_size=self.world_size, model=recipe.model,
                                            global_batch_size=recipe.global_batch_size,
                                            micro_batch_size=recipe.micro_batch_size)
        topology = self.run.start(layout, world_size=self.world_size, node_rank=self.library.node_rank())
        elastic = self.elastic
        if elastic is not None and elastic.fills_model_later:
            self.run.switcher.world_watch()  # the next world's switch watch, where the others made theirs ahead
        self.run.set_optimizer(optimizer_settings)
        joining = elastic is not None and elastic.joining
        self.run.build_model(self.recipe, rank=dist.get_rank(), device=self.library.device, agree=not joining,
                             unfilled=elastic is not None and elastic.fills_model_later)
        if joining:  # the state and the progress come from the members (they checked the data already)
            elastic.join_state()
            elastic.end_catching_up()
            self._data_checked = True
        else:
            self.run.install(self.run.build_state())
        self.model = DynaTrainModel(self)
        self.optimizer = LoopOptimizer(self)
        self.scheduler = DynaTrainScheduler(self)
        self._detach = self.library.attach(self)
        self.library.print(f"[dynatrain] layout {layout} on {self.world_size} processes ({self.library.describe()}), "
                           f"params {str(dtype).removeprefix('torch.')}, {topology}; {self.settings}")

    # ------------------------------------------------------------------------------ state
    @property
    def state(self) -> "MegatronState":
        """The current layout's megatron state (groups, model shard, DDP, optimizer)."""
        state = self.run.state_or_none
        if state is None:
            raise RuntimeError("DynaTrainEngine.close() has run: the megatron state is gone. HINT: build a new "
                               "engine to train again")
        return state

    @property
    def layout(self) -> ParallelConfig:
        """The layout training runs at now."""
        return self.state.layout

    @property
    def optimizer_settings(self) -> "AdamSettings | OptimizerConfig":
        """The optimizer's settings, as given (every layout's optimizer is built from them)."""
        return self._optimizer_settings

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """Processes training now (in an elastic run, the job's current world)."""
        return dist.get_world_size()

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step at the current layout: global // (dp * micro)."""
        return self.run.num_microbatches

    @property
    def refusals(self) -> list[tuple[int, str, str, str]]:
        """Schedule entries whose switch was refused: (step, layout, error type, message)."""
        return self.schedule.refusals

    def _say(self, message: str) -> None:
        self.library.print(f"[dynatrain] {message}")

    # ------------------------------------------------------------------------------- data
    def dataloader(self, dataset: "Dataset", *, shuffle: bool = True, seed: int = 0,
                   num_workers: int = 0) -> "GlobalBatchDataLoader":
        """A loader of GLOBAL batches (``recipe.global_batch_size`` rows, the same on every rank),
        which ``accelerator.prepare`` and ``fabric.setup_dataloaders`` leave alone
        (``data.global_batch_loader``); the engine keeps it at the data position of its step
        (``step * G``), a resume included."""
        from lightning_dynatrain.loop.data import global_batch_loader

        loader = global_batch_loader(dataset, global_batch_size=self.recipe.global_batch_size, shuffle=shuffle,
                                     seed=seed, num_workers=num_workers)
        loader.batch_sampler.set_step(self.step)
        self._samplers.append(loader.batch_sampler)
        return loader

    def eval_dataloader(self, dataset: "Dataset", *, num_workers: int = 0) -> "GlobalBatchDataLoader":
        """A loader of GLOBAL batches of ``dataset`` in order, for ``eval_step``: every pass reads it
        from the start (the training position does not move it)."""
        from lightning_dynatrain.loop.data import global_batch_loader

        return global_batch_loader(dataset, global_batch_size=self.recipe.global_batch_size, num_workers=num_workers,
                                   for_eval=True)

    # ------------------------------------------------------------------------------ steps
    def train_step(self, batch: Mapping[str, torch.Tensor], *, forward_step: Callable | None = None) -> float:
        """One optimizer step over the global ``batch`` (the fused megatron step); the global mean loss.
        ``forward_step``: this step's (an RL step: ``PolicyLoss(...).forward_step``), default the model's.

        A schedule entry due at this step boundary runs first.

        Raises:
            BatchSizeError: the batch is not a global batch of ``recipe.global_batch_size`` rows.
            DataMismatchError: (first step) the ranks were handed different batches.
        """
        import time

        if self.should_stop:
            raise LoopSetupError(f"this process left the elastic job after step {self.step}: it trains no more",
                                 hint="end the loop once engine.should_stop is True, then engine.close()")
        self.step_boundary()
        if not self._data_checked:
            _check_same_batch(batch, step=self.step)
            self._data_checked = True
        switcher = self.run.switcher
        beside_build, start = switcher.building, time.perf_counter()
        lr = self.lr_at(self.step)
        if self.elastic is None:
            loss = self.run.train_step(batch, lr=lr, weight_decay=self.weight_decay, forward_step=forward_step)
        else:  # a member lost in the step: recovered from, the step again at the survivors' layout
            loss = step_recovering(self.elastic, self.step + 1, batch, lr=lr, weight_decay=self.weight_decay,
                                   forward_step=forward_step)
        switcher.step_ran(time.perf_counter() - start, beside_build=beside_build)
        self.step += 1
        if self.elastic is not None:
            self._elastic_boundary()
        return loss

    def eval_step(self, batch: Mapping[str, torch.Tensor]) -> float:
        """The global mean loss of the global ``batch`` at the current layout, forward only (megatron's
        forward-only schedule across pipeline stages); the same float on every rank, and the same at
        every layout for the same weights. Nothing trains and no switch runs."""
        return self.run.eval_step(batch)

    def step_boundary(self) -> ReconfigReport | None:
        """Run the schedule's switch due now (``SwitchSchedule.run_due``: entries at or before ``step``
        not run yet, the latest wins), then start building the next one ahead
        (``settings.schedule_ahead``). A switch refused before anything moved (or rolled back with the
        old state whole) is printed and recorded in ``refusals``, and training goes on at the old
        layout, unless ``settings.on_refused="raise"``."""
        if self.should_stop:  # this process left the elastic job: nothing runs here any more
            return None
        report = self.schedule.run_due(self.step, switch=self.reconfigure, current=lambda: self.layout, say=self._say)
        self.schedule.prepare_next(self.step, current=self.layout, prepared=self.run.switcher.prepared_pair,
                                   prepare=self.run.prepare, say=self._say)
        return report

    def reconfigure(self, target: str | ParallelConfig) -> ReconfigReport:
        """Switch to layout ``target`` now, in memory (collective: every rank, the same target, between steps).

        Raises (the checks before anything moves are ``TrainingRun.check``'s, as under the Trainer):
            LayoutError / WorldSizeError / BatchSizeError: the target does not fit.
            SwitchMemoryError: it would not fit in memory (or exceed the settings' limit); nothing
                moved, training can go on at the current layout.
        """
        layout = self.run.check(target)
        if self.elastic is None:
            report = self.run.switch(layout, step=self.step)
        else:
            report, lost = switch_recovering(self.elastic, layout, step=self.step)
            if lost:  # the survivors went on at their world's layout (the recovery said so)
                return report
        if not report.noop:
            self.history.append(report)
        self.library.print(str(report))
        return report

    def rollout(self, layout: str | ParallelConfig, *, park: str = "in_place", keep_weights: bool = True):
        """``with engine.rollout(layout) as policy:`` the training weights at ``layout`` for generation,
        between two steps (``TrainingRun.rollout``, ``docs/rollout.md``). Collective. In an elastic run
        a member lost in the phase is recovered from and the ``with`` raises ``RolloutInterrupted``:
        the survivors drop the phase's results and run the iteration again."""
        if self.elastic is None:
            return self.run.rollout(layout, park=park, keep_weights=keep_weights)
        return rollout_recovering(self.elastic, layout, park=park, keep_weights=keep_weights, step=self.step)

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The run's progress, the same on every rank (Accelerate saves it from rank 0 as a custom
        checkpoint, Fabric in ``fabric.ckpt``; the training state goes to the engine's layout-free
        checkpoint, ``checkpoint.py``)."""
        return {"step": self.step, "layout": str(self.layout), "schedule_done": sorted(self.schedule.done),
                "refusals": [list(r) for r in self.schedule.refusals],
                "history": [report.to_json() for report in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the progress (after the engine's state: Accelerate loads custom checkpoints last,
        the Fabric strategy reads the engine's state first). The engine stays at its layout.

        Raises:
            CheckpointError: the progress is of another step than the state loaded (two checkpoints mixed).
        """
        from lightning_dynatrain.checkpoint.identity import CheckpointError

        if self.loaded_step is not None and int(state["step"]) != self.loaded_step:
            raise CheckpointError(f"the run's progress was saved at step {state['step']}, the training state "
                                  f"loaded is of step {self.loaded_step}",
                                  hint="load a checkpoint written by one save_state or fabric.save call")
        self.step = int(state["step"])
        self.schedule.load_state_dict(state)
        self.history = [ReconfigReport(**row) for row in state.get("history", ())]
        for sampler in self._samplers:
            sampler.set_step(self.step)

    # ------------------------------------------------------------------------------ elastic
    def _enter_job(self, options: "ElasticOptions") -> ParallelConfig | None:
        """Enter the elastic job through its store (``ElasticDriver.enter``): the first world's
        members get ``None`` (the settings' layout), a joiner the layout of the world it joins."""
        from lightning_dynatrain.loop.elastic_front import LoopFront

        self._leave_notice = LeaveNotice()
        self._leave_notice.listen()  # from before this process enters the job: a notice during its set-up counts
        front = LoopFront(self)
        self.elastic = options.driver(self.run, front)
        return self.elastic.enter(front.launch())

    def _elastic_boundary(self) -> None:
        """After optimizer step ``step``: a leave notice asks to leave here; the driver makes a change
        that is due (a grow, a shrink, this process's leave, which sets ``should_stop``)."""
        assert self.elastic is not None and self._leave_notice is not None
        if self._leave_notice.take():
            self.elastic.leave(self.step)
        self.elastic.at_boundary()

    def close(self, *, finished: bool = True) -> None:
        """Release megatron's groups and the library's checkpoint wiring (before ``accelerator.end_training()``
        or the end of the Fabric script); in an elastic run, this process's part of the job ends
        (``finished=False``: on an error, and the job's store records it failed at once)."""
        for undo in self._detach:
            undo()
        self._detach = []
        self.run.close()
        if self.elastic is not None:
            self.elastic.close(finished=finished)
        if self._leave_notice is not None:
            self._leave_notice.restore()
            self._leave_notice = None

    def __enter__(self) -> "DynaTrainEngine":
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.close(finished=exc_type is None)

    def __repr__(self) -> str:
        state = self.run.state_or_none
        where = str(state.layout) if state is not None else "closed"
        return f"{type(self).__name__}({where}, step {self.step}, {len(self.history)} switches)"


def _settings_of(library: LoopLibrary, given: "DynaTrainSettings | None") -> "DynaTrainSettings":
    """The run's settings: the library's own (Fabric's strategy holds them), else ``given``, else the
    defaults and ``DYNATRAIN_*`` variables.

    Raises:
        LoopSetupError: settings given where the library holds them.
    """
    held = library.settings
    if held is not None and given is not None and given != held:
        raise LoopSetupError(f"settings were given ({given}) but the {library.name} strategy holds them ({held})",
                             hint=f"pass the layout, schedule and budgets to the {library.name} strategy only")
    return held if held is not None else given if given is not None else DynaTrainSettings.from_environment()


class _Constant:
    """``lr_at`` when none is given: the settings' ``lr`` at every step."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def __call__(self, step: int) -> float:
        return self.lr


def _check_same_batch(batch: Mapping[str, torch.Tensor], *, step: int) -> None:
    """Every rank holds the same global batch (one small all-gather): a loader that Accelerate's
    ``prepare`` sharded by world size hands each rank other rows, which under tensor or pipeline
    parallelism trains on garbage without failing."""
    tokens = batch["tokens"]
    flat = tokens.detach().reshape(-1).to("cpu", torch.int64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64)
    everyone = every_rank((tuple(tokens.shape), int((flat * weights).sum())))
    if len(set(everyone)) > 1:
        raise DataMismatchError(
            f"the ranks were handed different batches for step {step + 1} (shapes and checksums {everyone})",
            hint="serve the same GLOBAL batch on every rank: build the loader with engine.dataloader(dataset) "
            "(accelerator.prepare and fabric.setup_dataloaders leave it alone); a DataLoader Accelerate prepared, "
            "or one Fabric gave a distributed sampler, is sharded by world size")


__all__ = ["DataMismatchError", "DynaTrainEngine", "LoopSetupError"]
