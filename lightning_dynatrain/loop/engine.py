"""``DynaTrainEngine``: a megatron-core GPT trained step by step in a plain loop, switching layout.

The engine holds the current layout's ``MegatronState`` (megatron's groups, the model shard, megatron
DDP and optimizer) and runs on the processes and default process group a loop library made:
Accelerate (``DynaTrainEngine(accelerator, plugin, ...)``) or Lightning Fabric
(``DynaTrainEngine(fabric, ...)`` under ``DynaTrainFabricStrategy``). What it takes from that
library goes through one small interface, ``host.LoopHost``. It is the loop counterpart of
``DynaTrainStrategy`` and calls the same plain functions:

- building: ``megatron_step.build_training_state`` (groups, the model shard checked against its
  description, DDP and optimizer: the steps the strategy runs across Lightning's hooks);
- one step: ``megatron_step.train_step`` (this rank's data-parallel share of the global batch,
  the step's learning rate, megatron's pipeline schedule: forward and backward over the
  micro-batches, finalize grads, optimizer step) -- one call, so pipeline stages need nothing
  from the loop;
- a switch: ``strategy.switching.LayoutSwitcher`` (``megatron.hot_switch``: the same planner, engine
  and megatron adapter as the Lightning strategy).

When a switch runs: ``reconfigure(target)`` at once (call it between steps, on every rank); a
schedule entry ``S: L`` of the plugin once ``S`` optimizer steps are done, at the first step
boundary after that (``optimizer.step()`` of the loop, else the start of the next step). Rank 0 of
each node prints one line per switch (the host's ``print``)::

    [dynatrain] step 2: dp2-tp2-pp1 -> dp1-tp2-pp2 in 0.412 s, moved 12.0 MiB (...), retained 30.1 MiB (...)

The loss each step returns is the global batch's mean token loss, already reduced over the
data-parallel ranks and sent from the last pipeline stage: the same float on every rank, so it
needs no further reduction (``accelerator.gather_for_metrics`` or ``fabric.all_gather`` over it
returns one equal copy per process).

The learning rate of step ``k`` (0-based) is ``lr_at(k)``: a function of the step count, so it
survives switches and resumes untouched, as under the Lightning strategy. Weight decay is the
optimizer settings' ``weight_decay``, applied the way megatron's scheduler does (``set_lr_and_wd``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_dynatrain.callbacks.scheduled import next_to_prepare
from lightning_dynatrain.loop.gather import every_rank
from lightning_dynatrain.loop.host import LoopHost, as_host
from lightning_dynatrain.strategy.config import AdamSettings, MegatronRecipe, optimizer_config
from lightning_dynatrain.strategy.report import ReconfigReport
from lightning_dynatrain.strategy.switching import LayoutSwitcher
from lightning_dynatrain.strategy.validation import validate_target
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig
    from torch.utils.data import Dataset

    from lightning_dynatrain.accelerate.plugin import DynaTrainPlugin
    from lightning_dynatrain.data.datamodule import GlobalBatchDataLoader
    from lightning_dynatrain.data.sampler import GlobalBatchSampler
    from lightning_dynatrain.megatron.state import MegatronState


class DataMismatchError(DynaTrainError):
    """The ranks were handed different batches for the same step."""


class LoopSetupError(DynaTrainError):
    """The loop library (or how it was launched) is set up in a way the megatron step cannot use."""


class DynaTrainEngine:
    """The current layout's megatron state, its step, its switches (see the module docstring).

    Collective: every rank builds it with the same arguments, and calls ``train_step`` and
    ``reconfigure`` in the same order.

    Args:
        host: a started ``Accelerator`` or a launched ``Fabric`` (``DynaTrainFabricStrategy``), or any
            ``LoopHost``: its processes, default process group, device and precision are used.
        plugin: the layout, the switch schedule and budgets. Under Accelerate it is this argument
            (default: ``DynaTrainPlugin()``, from ``DYNATRAIN_*`` variables); under Fabric the
            strategy holds it (leave this ``None``).
        recipe: the layout-free model (the GPT preset's ``GPTShape`` or a ``ModelProvider``) and the
            batch sizes; ``params_dtype`` follows the host's precision (leave it ``None``).
        optimizer: megatron's ``OptimizerConfig`` (Adam or SGD; ``lr`` the peak rate) or
            ``AdamSettings``.
        adam: ``AdamSettings``, the same as ``optimizer=`` (give one of the two).
        lr_at: learning rate of optimizer step ``k`` (0-based); default the constant ``lr``.

    Raises:
        AcceleratorSetupError / FabricSetupError: the host cannot run the megatron step (no process
            group, a sharding engine of its own, gradient accumulation, fp16, ...).
        LoopSetupError: the recipe's dtype disagrees with the host's precision, a plugin was given
            where the host holds one, or not exactly one of ``optimizer`` and ``adam``.
        LayoutError / WorldSizeError / BatchSizeError / ScheduleError: the plugin's layout or a
            schedule entry does not fit the world, the model or the batch sizes.

    Attributes:
        model, optimizer, scheduler: what the loop hands to ``accelerator.prepare`` or
            ``fabric.setup`` (``prepared.py``), which keep them from wrapping and sharding.
        history: every switch that moved state, in order (the same on every rank).
    """

    def __init__(self, host: Any, plugin: "DynaTrainPlugin | None" = None, *, recipe: MegatronRecipe,
                 optimizer: "AdamSettings | OptimizerConfig | None" = None, adam: AdamSettings | None = None,
                 lr_at: Callable[[int], float] | None = None) -> None:
        from lightning_dynatrain.loop.prepared import DynaTrainModel, DynaTrainScheduler, LoopOptimizer
        from lightning_dynatrain.strategy.megatron_step import build_training_state
        from lightning_dynatrain.strategy.topology import gather_topology

        if (optimizer is None) == (adam is None):
            raise LoopSetupError("DynaTrainEngine takes the optimizer's settings once: " + (
                "neither optimizer= nor adam= was given" if optimizer is None else "both optimizer= and adam="),
                hint="pass optimizer=OptimizerConfig(optimizer='adam', lr=...) (or AdamSettings)")

        self.host: LoopHost = as_host(host)
        dtype = self.host.params_dtype
        if recipe.params_dtype not in (None, dtype):
            raise LoopSetupError(
                f"MegatronRecipe(params_dtype={recipe.params_dtype}) disagrees with the {self.host.name} "
                f"precision ({dtype})", hint=f"leave params_dtype=None: the {self.host.name} precision says it")
        self.plugin = _plugin_of(self.host, plugin)
        #: the optimizer's settings, as given (every layout's optimizer is built from them)
        self.optimizer_settings: AdamSettings | OptimizerConfig = optimizer if optimizer is not None else adam
        config = optimizer_config(self.optimizer_settings)
        self.weight_decay = config.weight_decay
        self.recipe = replace(recipe, params_dtype=dtype)
        self.lr_at: Callable[[int], float] = lr_at if lr_at is not None else _Constant(config.lr)
        self.world_size = dist.get_world_size()
        settings = self.plugin
        layout = settings.validate(world_size=self.world_size, model=recipe.model,
                                 global_batch_size=recipe.global_batch_size, micro_batch_size=recipe.micro_batch_size)
        self.switcher = LayoutSwitcher(staging_budget=settings.staging_budget,
                                       memory_limit=settings.switch_memory_limit, verify=settings.verify,
                                       promote_broadcasts=settings.promote_broadcasts,
                                       switch_timeout=settings.switch_timeout,
                                       resume_from=lambda: self.last_checkpoint,
                                       keep_old=settings.switch_safety == "keep_old")
        self._state: MegatronState | None = build_training_state(
            self.recipe, layout, self.optimizer_settings, seed=settings.seed, rank=dist.get_rank(),
            groups=self.switcher.groups, device=self.host.device)
        topology = gather_topology(self.host.cluster_environment())
        self.switcher.new_world(topology)
        #: optimizer steps done
        self.step = 0
        #: the step of the checkpoint last loaded into the state (``loop.checkpoint``), else None
        self.loaded_step: int | None = None
        #: the checkpoint folder last saved or loaded (a failed switch names it to resume from), else None
        self.last_checkpoint: str | None = None
        self.history: list[ReconfigReport] = []
        #: schedule entries whose switch was refused: (step, layout, error type, message)
        self.refusals: list[tuple[int, str, str, str]] = []
        self._done: set[int] = set()
        self._not_ahead: set[int] = set()  # schedule entries whose build could not start
        self._samplers: list[GlobalBatchSampler] = []
        self._data_checked = False
        self.model = DynaTrainModel(self)
        self.optimizer = LoopOptimizer(self)
        self.scheduler = DynaTrainScheduler(self)
        self._detach = self.host.attach(self)
        self.host.print(f"[dynatrain] layout {layout} on {self.world_size} processes ({self.host.describe()}), "
                        f"params {str(dtype).removeprefix('torch.')}, {topology}; {settings}")

    # ------------------------------------------------------------------------------ state
    @property
    def state(self) -> "MegatronState":
        """The current layout's megatron state (groups, model shard, DDP, optimizer)."""
        if self._state is None:
            raise RuntimeError("DynaTrainEngine.close() has run: the megatron state is gone. HINT: build a new "
                               "engine to train again")
        return self._state

    @property
    def layout(self) -> ParallelConfig:
        """The layout training runs at now."""
        return self.state.layout

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step at the current layout: global // (dp * micro)."""
        from lightning_dynatrain.strategy.megatron_step import microbatches

        return microbatches(self.recipe, self.layout)

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
    def train_step(self, batch: Mapping[str, torch.Tensor]) -> float:
        """One optimizer step over the global ``batch`` (the fused megatron step); the global mean loss.

        A schedule entry due at this step boundary runs first.

        Raises:
            BatchSizeError: the batch is not a global batch of ``recipe.global_batch_size`` rows.
            DataMismatchError: (first step) the ranks were handed different batches.
        """
        from lightning_dynatrain.strategy.megatron_step import train_step

        self.step_boundary()
        if not self._data_checked:
            _check_same_batch(batch, step=self.step)
            self._data_checked = True
        beside_build, start = self.switcher.building, time.perf_counter()
        loss = train_step(self.state, batch, self.recipe, lr=self.lr_at(self.step), weight_decay=self.weight_decay)
        self.switcher.step_ran(time.perf_counter() - start, beside_build=beside_build)
        self.step += 1
        return loss

    def eval_step(self, batch: Mapping[str, torch.Tensor]) -> float:
        """The global mean loss of the global ``batch`` at the current layout, forward only (megatron's
        forward-only schedule across pipeline stages); the same float on every rank, and the same at
        every layout for the same weights. Nothing trains and no switch runs."""
        from lightning_dynatrain.strategy.megatron_step import eval_step

        state = self.state
        return eval_step(state.ddp, state.groups, state.layout, batch, self.recipe)

    def step_boundary(self) -> ReconfigReport | None:
        """Run the schedule's switch due now (entries at or before ``step`` not run yet: the latest
        wins), then start building the next one ahead (``plugin.schedule_ahead``). A switch refused
        before anything moved (or rolled back with the old state whole) is printed and recorded in
        ``refusals``, and training goes on at the old layout, unless ``plugin.on_refused="raise"``."""
        due = [s for s, _ in self.plugin.schedule if s <= self.step and s not in self._done]
        report = None
        if due:
            self._done.update(due)
            report = self._scheduled_switch(max(due))
        self._prepare_next()
        return report

    def _scheduled_switch(self, step: int) -> ReconfigReport | None:
        """The schedule's switch of entry ``step``; a refusal goes by under ``on_refused="continue"``."""
        from lightning_dynatrain.callbacks.scheduled import refusal_message
        from lightning_dynatrain.engine.errors import was_refused

        layout = self.plugin.schedule_map[step]
        try:
            return self.reconfigure(layout)
        except DynaTrainError as err:  # the same on every rank
            if self.plugin.on_refused == "raise" or not was_refused(err):
                raise
            self.refusals.append((step, str(layout), type(err).__name__, str(err)))
            self.host.print(f"[dynatrain] {refusal_message(step, layout, err, self.layout)}")
            return None

    def _prepare_next(self) -> None:
        """The next entry that changes the layout, built in the background (once per entry)."""
        entry = next_to_prepare(self.plugin.schedule, after=self.step, skip=self._done | self._not_ahead,
                                current=self.layout, prepared=self.switcher.prepared_pair)
        if not self.plugin.schedule_ahead or entry is None:
            return
        step, layout = entry
        try:
            if not self.switcher.prepare(self.state, layout, recipe=self.recipe, optimizer=self.optimizer_settings):
                self._not_ahead.add(step)  # a build failed in this run: switches build on demand
        except DynaTrainError as err:  # the same on every rank: the switch builds when it runs
            self._not_ahead.add(step)
            self.host.print(f"[dynatrain] the switch to {layout} at step {step} cannot be built ahead "
                                   f"({type(err).__name__}: {err}); it will be built when it runs")

    def reconfigure(self, target: str | ParallelConfig) -> ReconfigReport:
        """Switch to layout ``target`` now, in memory (collective: every rank, the same target, between steps).

        Raises:
            LayoutError / WorldSizeError / BatchSizeError: the target does not fit.
            SwitchMemoryError: it would not fit in memory (or exceed the plugin's limit); nothing
                moved, training can go on at the current layout.
        """
        layout = validate_target(target, world_size=self.world_size, current=self.layout, model=self.recipe.model,
                                 global_batch_size=self.recipe.global_batch_size,
                                 micro_batch_size=self.recipe.micro_batch_size, execution=self.recipe.execution)
        if layout == self.layout:
            report = ReconfigReport(step=self.step, src=str(layout), dst=str(layout))
        else:
            from lightning_dynatrain.megatron.state import release_state

            old = self.state
            self._state, report = self.switcher.switch(old, layout, recipe=self.recipe,
                                                       optimizer=self.optimizer_settings,
                                                       step=self.step, deferred=False)
            release_state(old)  # taken apart: reference counting frees it (``megatron.state``)
            self.history.append(report)
        self.host.print(str(report))
        return report

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The run's progress, the same on every rank (Accelerate saves it from rank 0 as a custom
        checkpoint, Fabric in ``fabric.ckpt``; the training state goes to the engine's layout-free
        checkpoint, ``checkpoint.py``)."""
        return {"step": self.step, "layout": str(self.layout), "schedule_done": sorted(self._done),
                "refusals": [list(r) for r in self.refusals],
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
        self._done = {int(s) for s in state.get("schedule_done", ())}
        self.refusals = [tuple(r) for r in state.get("refusals", ())]
        self.history = [ReconfigReport(**row) for row in state.get("history", ())]
        for sampler in self._samplers:
            sampler.set_step(self.step)

    def close(self) -> None:
        """Release megatron's groups and the host's checkpoint wiring (before ``accelerator.end_training()``
        or the end of the Fabric script)."""
        from lightning_dynatrain.strategy.megatron_step import teardown_state

        for undo in self._detach:
            undo()
        self._detach = []
        if self._state is not None and dist.is_available() and dist.is_initialized():
            teardown_state()
            self.switcher.close()
        self._state = None

    def __enter__(self) -> "DynaTrainEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = str(self._state.layout) if self._state is not None else "closed"
        return f"DynaTrainEngine({where}, step {self.step}, {len(self.history)} switches)"


def _plugin_of(host: LoopHost, given: "DynaTrainPlugin | None") -> "DynaTrainPlugin":
    """The run's settings: the host's own (Fabric's strategy holds them), else ``given``, else the
    defaults and ``DYNATRAIN_*`` variables.

    Raises:
        LoopSetupError: a plugin given where the host holds one.
    """
    from lightning_dynatrain.accelerate.plugin import DynaTrainPlugin

    held = host.plugin
    if held is not None and given is not None and given != held:
        raise LoopSetupError(f"a plugin was given ({given}) but the {host.name} strategy holds the settings ({held})",
                             hint=f"pass the layout, schedule and budgets to the {host.name} strategy only")
    return held if held is not None else given if given is not None else DynaTrainPlugin()


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
