"""``DynaTrainStrategy``: Lightning training of a megatron-core model whose parallel layout can change in memory.

The strategy is Lightning's side of a run; the run itself is a ``runtime.training_run.TrainingRun``
(the Lightning-free training core the Fabric and Accelerate loop engine uses too), which it builds
across Lightning's hooks: the starting layout's groups in ``setup_environment``, the model shard in
``configure_model`` (through ``build_model``), megatron DDP and optimizer in ``setup_optimizers``.
Ranks, devices, precision and collectives come from its base, ``processes.MegatronProcessStrategy``.
What is left it hands to three parts, each given what it may touch:

- ``switch_requests.SwitchRequests``: when a layout switch runs (``reconfigure``,
  ``prepare_reconfigure``, at the optimizer-step boundary) and how it is logged;
- ``stepping.Stepping``: the step entry points (``train_step``, ``eval_step``) and ``reduce``;
- ``checkpoint_hooks.Checkpointing``: Lightning's save and restore hooks, onto layout-free checkpoint
  directories (a run saved at one layout resumes at any other layout and world size).

With an ``OnNodeChange`` callback the run is elastic: the callback makes the driver
(``elastic.driver.ElasticDriver``), which reaches Lightning only through ``elastic_front.LightningFront``.
Every data-parallel notion (``distributed_sampler_kwargs``, ``reduce``) comes from the *current layout*.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dynatrain.checkpoint.writer import CheckpointWriter
from lightning_dynatrain.compat.lightning_internals import lightning_optimizers
from lightning_dynatrain.data.sampler import global_batch_samplers
from lightning_dynatrain.elastic.driver.front import ElasticCallback
from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe
from lightning_dynatrain.runtime.reconfig_report import ReconfigReport
from lightning_dynatrain.runtime.settings import DynaTrainSettings
from lightning_dynatrain.runtime.training_run import TrainingRun
from lightning_dynatrain.strategy.checkpoint_hooks import Checkpointing
from lightning_dynatrain.strategy.elastic_front import LightningFront
from lightning_dynatrain.strategy.optimizer_handle import DynaTrainOptimizer, handle_for
from lightning_dynatrain.strategy.precision import resolve_params_dtype
from lightning_dynatrain.strategy.processes import MegatronProcessStrategy
from lightning_dynatrain.strategy.stepping import Stepping
from lightning_dynatrain.strategy.switch_requests import SwitchRequests
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    from lightning_dynatrain.elastic.driver.driver import ElasticDriver
    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.runtime.switcher import LayoutSwitcher


class DynaTrainStrategy(MegatronProcessStrategy):
    """Megatron-core GPT training under Lightning, with in-memory layout switches.

    Args:
        layout: the starting layout, e.g. ``"dp2-tp2-pp1"`` or a ``ParallelConfig``; ``"auto"`` is pure
            data parallelism over every process (``dp{world}-tp1-pp1``).
        staging_budget: bytes of in-flight buffers a switch may use (``"256MiB"``, an int, ...).
        switch_memory_limit: at most this many bytes a switch may take on one rank beyond the state
            (``"4GiB"``, an int, ...); ``None``: no limit of its own. Either way every switch first
            checks that it fits in each host's (or device's) free memory.
        backend: process-group backend; ``None`` picks nccl on CUDA devices and gloo otherwise.
        verify: after each switch, gather and compare the full logical state (slow; for tests).
        promote_broadcasts: measure the links once per world (at the first switch) and let switches
            broadcast a box many new replicas need, where the measured costs say that pays.
        async_save: write checkpoints in the background (``torch.distributed.checkpoint.async_save``):
            a save costs the step a copy of this rank's share of the state to CPU memory; the next
            save, removing that checkpoint and teardown wait for it.
        init_from_megatron: a checkpoint directory megatron-core's ``dist_checkpointing`` wrote for
            the same model (Megatron-LM, NeMo; distributed optimizer in its ``fully_reshardable``
            format): ``fit`` starts from its weights and optimizer state, at this strategy's layout,
            with Lightning's counters at 0 (``validate`` loads the weights). Ignored when ``fit`` or
            ``validate`` is given a ``ckpt_path``: a run being resumed goes on from its own checkpoint.
        timeout: timeout of collectives (``init_process_group``).
        switch_timeout: how long any wait of a switch may take (seconds or a ``timedelta``); ``None``:
            derived from each switch's bytes and the measured links, with a wide margin and a 60 s
            floor (``transition.deadline``). Past it every other rank raises ``SwitchFailedError`` naming
            the rank and the phase (``docs/switch-faults.md``).
        switch_safety: ``"fast"`` (default): a switch frees the old state as it moves it (a failed
            switch loses the state of its step: resume from the last checkpoint); ``"keep_old"``: the
            old state is held until every rank confirmed its new state (the memory check counts it),
            so a failed switch rolls back to the old layout on every surviving rank.
        cluster_environment: Lightning's cluster environment; ``None`` lets the Trainer detect it.
        seed: seed of megatron's RNG trackers (model weights are seeded by the module's recipe).
        parallel_devices: as for any Lightning ``ParallelStrategy``.
        checkpoint_io: unused: checkpoints are DCP directories the strategy writes itself.
        precision_plugin: leave it out and pass ``Trainer(precision="bf16-mixed" | "32-true")``: the
            strategy runs megatron's own mixed precision (``strategy.precision``), never autocast.

    The switch settings are parsed once into ``settings`` (``runtime.settings.DynaTrainSettings``, the
    type every front end uses); the megatron side of the run is ``run`` (``runtime.training_run.TrainingRun``).

    Raises:
        LayoutError: ``layout`` cannot be parsed (at construction) or does not fit the world or the
            model (at ``setup_environment`` / ``configure_model``).
        StagingBudgetError: ``staging_budget`` or ``switch_memory_limit`` is not a byte count.
        SettingsError: ``switch_safety`` (or another setting) is not one of its values.
        SwitchMemoryError: (at a switch) it would not fit in memory, or exceed ``switch_memory_limit``;
            nothing was moved and training can go on at the old layout.
        SwitchFailedError: (at a switch) a rank died or stalled, or a wait ran past ``switch_timeout``.
        CheckpointMismatchError: (at ``ckpt_path`` / ``init_from_megatron``) the checkpoint holds another
            model or precision; nothing was loaded.
        CheckpointError: (same) the path is not a checkpoint this strategy reads.
    """

    strategy_name = "dynatrain"

    def __init__(
        self,
        layout: str | ParallelConfig = "auto",
        *,
        staging_budget: int | str = "256MiB",
        switch_memory_limit: int | str | None = None,
        backend: str | None = None,
        verify: bool = False,
        promote_broadcasts: bool = True,
        async_save: bool = False,
        init_from_megatron: str | os.PathLike | None = None,
        timeout: timedelta = timedelta(minutes=30),
        switch_timeout: float | timedelta | None = None,
        switch_safety: Literal["fast", "keep_old"] = "fast",
        cluster_environment: ClusterEnvironment | None = None,
        seed: int = 1234,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(backend=backend, timeout=timeout, cluster_environment=cluster_environment,
                         parallel_devices=parallel_devices, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.settings = DynaTrainSettings(layout=layout, staging_budget=staging_budget, seed=seed,
                                          switch_memory_limit=switch_memory_limit, verify=verify,
                                          promote_broadcasts=promote_broadcasts, switch_timeout=switch_timeout,
                                          switch_safety=switch_safety)
        self.init_from_megatron = None if init_from_megatron is None else Path(init_from_megatron)
        self._elastic: ElasticDriver | None = None  # with an OnNodeChange callback
        self.run = TrainingRun(self.settings, training_timeout=timeout, resume_from=lambda: self.checkpointing.latest_path(),
                               warn=rank_zero_warn, on_install=self._point_lightning_at)
        self.checkpointing = Checkpointing(self.run, writer=CheckpointWriter(async_save=async_save),
                                           trainer=self._running_trainer, handle=lambda: self.optimizer_handle,
                                           joining=self._joining)
        self.switch_requests = SwitchRequests(self.run, elastic=lambda: self._elastic, trainer=self._running_trainer)
        self.stepping = Stepping(self.run, handle=lambda: self.optimizer_handle, elastic=lambda: self._elastic,
                                 trainer=self._running_trainer, local_collectives=self._collectives_are_local)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="megatron-core GPT with in-memory layout switches (auto layout)")

    # ----------------------------------------------------------- what runs now: the run's
    @property
    def layout(self) -> ParallelConfig:
        """The layout training runs at now."""
        return self.run.layout

    @property
    def recipe(self) -> MegatronRecipe:
        """The model's recipe ``build_model`` was given."""
        return self.run.recipe

    @property
    def switcher(self) -> "LayoutSwitcher":
        """What every switch of this run shares (made in ``setup_environment``)."""
        return self.run.switcher

    @property
    def optimizer_settings(self) -> "AdamSettings | OptimizerConfig":
        """The optimizer settings ``configure_optimizers`` gave."""
        return self.run.optimizer_settings

    @property
    def model_shard(self) -> torch.nn.Module:
        """This rank's megatron model shard (built in ``configure_model``)."""
        return self.run.model_shard

    @property
    def megatron(self) -> "MegatronState":
        """The current layout's megatron state (groups, model, DDP, optimizer)."""
        return self.run.state

    @property
    def megatron_or_none(self) -> "MegatronState | None":
        """``megatron``, or ``None`` before ``setup`` built it (a ``validate`` run builds none)."""
        return self.run.state_or_none

    @property
    def groups(self) -> "ProcessGroupCollection":
        """Megatron's groups of the current layout."""
        return self.run.groups

    @property
    def optimizer_handle(self) -> DynaTrainOptimizer:
        """The optimizer Lightning steps (its schedule group holds the rate the next step uses)."""
        handle = self.optimizers[0] if self.optimizers else None
        assert isinstance(handle, DynaTrainOptimizer), "setup_optimizers makes it"
        return handle

    @property
    def elastic(self) -> "ElasticDriver | None":
        """The elastic side (an ``OnNodeChange`` callback is present), else ``None``."""
        return self._elastic

    @property
    def switch_history(self) -> list[ReconfigReport]:
        """Every switch that ran (no-ops excluded), in order; the same on every rank."""
        return self.switch_requests.history

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas and this rank's index among them, at the current layout."""
        coord = self.layout.dense_coord(self.global_rank)
        return {"num_replicas": self.layout.dp * self.layout.cp, "rank": coord.dp * self.layout.cp + coord.cp}

    def _point_lightning_at(self, state: "MegatronState") -> None:
        """The run installed ``state`` (set-up, every switch, world change, recovery): the module's
        ``model`` and Lightning's optimizer handle follow it."""
        module = self.lightning_module
        if module is not None and getattr(module, "model", None) is not state.model:
            module.model = state.model
        self.optimizer_handle.rebind(state)

    def _joining(self) -> bool:
        return self._elastic is not None and self._elastic.joining

    # ---------------------------------------------------------------------- life cycle hooks
    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # then megatron-core may be imported (TrainingRun.start)
        trainer = self._running_trainer()
        callback = next((c for c in (trainer.callbacks if trainer is not None else []) if isinstance(c, ElasticCallback)),
                        None)
        joined_at = None
        if callback is not None:  # elastic: the job's store makes the worlds (elastic/driver/)
            reset_seed()
            front = LightningFront(self)
            self._elastic = callback.make_driver(self.run, front)
            joined_at = self._elastic.enter(front.launch())
            self._owns_process_group = True  # its worlds are this process's to destroy
        else:
            self._setup_distributed()
        topology = self.run.start(joined_at or self.settings.layout, world_size=self.world_size,
                                  node_rank=self.cluster_environment.node_rank())
        if self._elastic is not None and self._elastic.fills_model_later:
            self.switcher.world_watch()  # the next world's switch watch, where the others made theirs ahead
        rank_zero_info(f"[dynatrain] layout {self.layout} on {self.world_size} processes "
                       f"({self.process_group_backend}, {self.cluster_environment.__class__.__name__}), {topology}")

    def build_model(self, recipe: MegatronRecipe) -> torch.nn.Module:
        """Build this rank's shard of ``recipe``'s model at the current layout; call from ``configure_model``.

        A ``ModelProvider``'s description is read here (on every rank alike), and the module built
        is checked against it on every rank.

        Raises:
            LayoutError / BatchSizeError: the layout does not fit the model or the batch sizes.
            ModelSpecError: the model has a parameter no sharded description covers, or state outside
                its parameters, or shards that no layout rule explains (the message names them).
        """
        recipe = replace(recipe, params_dtype=resolve_params_dtype(recipe.params_dtype, self.precision_plugin))
        elastic = self._elastic
        return self.run.build_model(recipe, rank=self.global_rank, device=self.root_device,
                                    agree=not self._collectives_are_local(),
                                    unfilled=elastic is not None and elastic.fills_model_later)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.run.model_shard_or_none is None:
            raise TypeError(
                "DynaTrainStrategy needs the megatron model built through the strategy. HINT: in "
                "LightningModule.configure_model() do `self.model = self.trainer.strategy.build_model(recipe)` "
                "(GPTLightningModule does)")
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.checkpointing.start_from_megatron(trainer, self.init_from_megatron)
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Build megatron DDP + optimizer for the current layout from ``configure_optimizers()``: a
        ``DynaTrainOptimizer`` (in any of Lightning's forms, with learning-rate schedulers), megatron's
        ``OptimizerConfig`` (constant rate) or ``AdamSettings`` (the GPT preset's, which sets each
        step's rate itself). A process joining an elastic run receives the state, and the trainer's,
        from the old members instead."""
        from megatron.core.optimizer import OptimizerConfig

        assert self.lightning_module is not None
        given = self.lightning_module.configure_optimizers()
        if not isinstance(given, (AdamSettings, OptimizerConfig)):
            super().setup_optimizers(trainer)  # Lightning's own parsing: optimizers and scheduler configs
        handle, schedulers = handle_for(given, self.optimizers, self.lr_scheduler_configs)
        self.optimizers, self.lr_scheduler_configs = [handle], list(schedulers)
        self.run.set_optimizer(given if isinstance(given, AdamSettings) else handle.config)
        if self._joining():  # the state comes from the old members
            self._elastic.join_state()
        else:
            self.run.install(self.run.build_state())

    # ------------------------------------------------------------- switching: switch_requests.py
    def check_layout(self, target: str | ParallelConfig) -> ParallelConfig:
        """The checked layout ``target`` or a typed error (``TrainingRun.check``: world, model, batch, optimizer)."""
        return self.run.check(target)

    def reconfigure(self, target: str | ParallelConfig) -> ReconfigReport | None:
        """Switch training to layout ``target`` at the optimizer-step boundary: the switch's report, or
        ``None`` when asked during a training step (it runs as the step returns). Collective: every
        rank, at the same step, with the same target. Returns and raises: ``SwitchRequests.reconfigure``."""
        return self.switch_requests.reconfigure(target)

    def prepare_reconfigure(self, target: str | ParallelConfig) -> bool:
        """Build the switch to ``target`` ahead, in the background, while training steps on; whether a
        build started. Collective: every rank, between the same two steps. Returns and raises:
        ``SwitchRequests.prepare_reconfigure``."""
        return self.switch_requests.prepare_reconfigure(target)

    def rollout(self, layout: str | ParallelConfig, *, park: str = "in_place", keep_weights: bool = True):
        """``with strategy.rollout(layout) as policy:`` the weights at ``layout``, between steps (``SwitchRequests.rollout``)."""
        return self.switch_requests.rollout(layout, park=park, keep_weights=keep_weights)

    @property
    def pending_layout(self) -> ParallelConfig | None:
        """A switch requested during the running step, not yet done."""
        return self.switch_requests.pending

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.switch_requests.run_step(partial(super().training_step, *args, **kwargs))

    # ------------------------------------------------------------------ steps: stepping.py
    def train_step(self, batch: Mapping[str, torch.Tensor], *, lr: float | None = None,
                   weight_decay: float | None = None, forward_step: Callable | None = None) -> float:
        """One optimizer step over the global ``batch`` (call from ``training_step``); the global mean loss.

        ``lr`` / ``weight_decay``: this step's values (times each megatron group's multipliers);
        ``None``: what the optimizer's schedule group holds (``DynaTrainOptimizer``: the config's, or
        what a scheduler set). ``forward_step``: this step's (an RL step: ``PolicyLoss(...).forward_step``),
        default the model's. Lightning counts it as an optimizer step (``trainer.global_step`` advances)."""
        return self.stepping.train_step(lightning_optimizers(self)[0], batch, lr=lr, weight_decay=weight_decay,
                                        forward_step=forward_step)

    def eval_step(self, batch: Mapping[str, torch.Tensor]) -> float:
        """The global mean loss of the global ``batch``, forward only, at the current layout (call
        from ``validation_step``); the same float on every rank, whatever the pipeline stage."""
        return self.run.eval_step(batch)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step at the current layout: global // (dp * micro)."""
        return self.run.num_microbatches

    @override
    def reduce(self, tensor: torch.Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> torch.Tensor | Any:
        """Reduce over the current layout's data-parallel group (``group=None``), or over ``group``."""
        return self.stepping.reduce(tensor, group, reduce_op)

    @override
    def _collectives_are_local(self) -> bool:
        return self._elastic is not None and self._elastic.local_collectives

    # ---------------------------------------------------------- checkpoints: checkpoint_hooks.py
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the weights are saved under their logical keys with the rest of the state (``save_checkpoint``)."""
        return {}

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.checkpointing.optimizer_state()

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return self.checkpointing.lightning_restores_optimizer

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        self.checkpointing.save(checkpoint, filepath, storage_options, rank=self.global_rank,
                                world_size=self.world_size)

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        self.checkpointing.remove(filepath, is_global_zero=self.is_global_zero)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpointing.read(checkpoint_path, weights_only, rank=self.global_rank, world_size=self.world_size)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self.checkpointing.load_params(checkpoint, rank=self.global_rank):  # a per-rank one: Lightning's way
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.checkpointing.load_optimizer(checkpoint, rank=self.global_rank):
            super().load_optimizer_state_dict(checkpoint)

    # ---------------------------------------------------------------------- life cycle, end
    @override
    def on_train_start(self) -> None:
        if self._elastic is not None:
            self._elastic.end_catching_up()
        # The data position is global_step * G: align every global-batch sampler (matters on resume).
        trainer = self._running_trainer()
        if trainer is not None:
            for sampler in global_batch_samplers(trainer.train_dataloader):
                sampler.set_step(trainer.global_step)

    @override
    def teardown(self) -> None:
        if dist.is_available() and dist.is_initialized():
            self.checkpointing.close()  # a background save completes before its groups go
        self.run.close()
        self.switch_requests.close()
        if self._elastic is not None:  # a fit an error interrupted: the store records this member failed at once
            trainer = self._running_trainer()
            self._elastic.close(finished=trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED)
        self._teardown_process_group()
        super().teardown()

    def __repr__(self) -> str:
        layout = self.run.layout_or_none or self.settings.layout
        return f"DynaTrainStrategy(layout={str(layout)!r}, staging_budget={self.settings.staging_budget})"


__all__ = ["DynaTrainStrategy"]

DynaTrainStrategy.register_strategies(StrategyRegistry)  # Trainer(strategy="dynatrain"): lightning_dynatrain/__init__.py
