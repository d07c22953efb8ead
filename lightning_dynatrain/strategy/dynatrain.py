"""``DynaTrainStrategy``: Lightning training of a megatron-core GPT whose parallel layout can change in memory.

The strategy owns megatron's side of training for the current layout (groups, model shard, megatron
DDP and optimizer, pipeline schedule; one ``MegatronState``) and gives Lightning what it expects
(an optimizer to count steps, checkpoints; ranks, devices, precision and collectives come from
``base.MegatronProcessStrategy``; the step entry points and ``reduce``: ``step_hooks.py``; switching:
``switch_hooks.py``). Hooks are thin; the work is in plain functions
(``megatron_step``, ``validation``, ``report``, ``checkpoint``, ``switching``).

Checkpoints (``trainer.save_checkpoint``, ``ModelCheckpoint``, ``fit(ckpt_path=...)``) are
layout-free directories: a run saved at one layout resumes at any other layout and world size
(the hooks: ``checkpoint_hooks.py``; ``strategy/checkpoint.py`` says which restores what, and why there).

Example::

    strategy = DynaTrainStrategy("dp2-tp2-pp1", staging_budget="256MiB")
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1000,
                      callbacks=[ScheduledReconfig({200: "dp1-tp2-pp2"})])
    trainer.fit(GPTLightningModule(shape, lr=3e-3, global_batch_size=16, micro_batch_size=2),
                datamodule=StdlibTextDataModule(seq_length=128, global_batch_size=16))

Launchers: ``python train.py`` (Lightning's subprocess launcher, as for DDP), ``torchrun`` and
``fabric run`` (TorchElasticEnvironment), ``srun`` (SLURMEnvironment). Lightning's ranks and world
come from the cluster environment; every data-parallel notion (``distributed_sampler_kwargs``,
``reduce``) comes from the *current layout*. Each process's intra-op threads are fitted to the cores
of its node, whatever the launcher set (``threads.py``; ``DYNATRAIN_NUM_THREADS=N`` overrides).

Data: the dataloader serves the same GLOBAL batch on every rank (``GlobalBatchSampler``); the
strategy slices this rank's data-parallel share at each step, so a switch needs no dataloader
rebuild (see ``base.py``); the loss the strategy returns is already the same on every rank.

Layout switches (``reconfigure``) run at the optimizer-step boundary: after optimizer step ``k``,
before step ``k+1``'s forward. Called between training steps (``on_train_batch_end`` /
``on_train_batch_start`` hooks, e.g. ``ScheduledReconfig``), a switch runs at once; called while a
training step runs (from ``training_step`` or a hook inside it), the target is recorded as pending
and runs as that step returns, before the ``on_train_batch_end`` hooks (a second request in the same
step replaces the first). Every ``training_step`` is one whole optimizer step over the global batch
(megatron's micro-batches inside it), so "mid accumulation" means "inside a training step". The
switch itself is ``switching.LayoutSwitcher``'s.
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dynatrain.checkpoint.writer import CheckpointWriter
from lightning_dynatrain.data.sampler import global_batch_samplers
from lightning_dynatrain.engine.deadline import parse_switch_timeout
from lightning_dynatrain.strategy.base import MegatronProcessStrategy
from lightning_dynatrain.strategy.checkpoint_hooks import CheckpointHooks
from lightning_dynatrain.strategy.step_hooks import StepHooks
from lightning_dynatrain.strategy.switch_hooks import SwitchHooks
from lightning_dynatrain.strategy.config import AdamSettings, MegatronRecipe
from lightning_dynatrain.strategy.optimizer_handle import DynaTrainOptimizer
from lightning_dynatrain.strategy.precision import resolve_params_dtype
from lightning_dynatrain.strategy.report import ReconfigReport
from lightning_dynatrain.strategy.switching import LayoutSwitcher, parse_switch_safety
from lightning_dynatrain.strategy.threads import fit_intra_op_threads
from lightning_dynatrain.strategy.validation import validate_optimizer, validate_target
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.warning_filters import quiet_third_party_warnings

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from megatron.core.optimizer import OptimizerConfig

    from megatron.core.process_groups_config import ProcessGroupCollection

    from lightning_dynatrain.callbacks.node_change import OnNodeChange
    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.strategy.elastic import ElasticDriver


def _parse_budget(value: int | str) -> int:
    from lightning_dynatrain.engine.staging import parse_bytes

    return parse_bytes(value)


class DynaTrainStrategy(SwitchHooks, CheckpointHooks, StepHooks, MegatronProcessStrategy):
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
            floor (``engine.deadline``). A rank that dies or stalls during a switch makes every other
            rank raise ``SwitchFailedError`` within it, naming the rank and the phase, and the last
            checkpoint to resume from.
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

    Raises:
        LayoutError: ``layout`` cannot be parsed (at construction) or does not fit the world or the
            model (at ``setup_environment`` / ``configure_model``).
        StagingBudgetError: ``staging_budget`` or ``switch_memory_limit`` is not a byte count.
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
        self._requested_layout: ParallelConfig | Literal["auto"] = (
            "auto" if isinstance(layout, str) and layout.strip().lower() == "auto" else ParallelConfig.parse(layout))
        self.staging_budget = _parse_budget(staging_budget)
        self.switch_memory_limit = None if switch_memory_limit is None else _parse_budget(switch_memory_limit)
        self.switch_timeout = parse_switch_timeout(switch_timeout)
        self.switch_safety = parse_switch_safety(switch_safety)
        self.verify = verify
        self.promote_broadcasts = promote_broadcasts
        self.seed = seed
        self._layout: ParallelConfig | None = None
        # what every switch shares, with the groups of every layout used (made at setup: megatron
        # is imported only then); switching back to a layout costs no group work
        self._switcher: LayoutSwitcher | None = None
        self._pgs: ProcessGroupCollection | None = None
        self._recipe: MegatronRecipe | None = None
        self._optimizer_settings: AdamSettings | OptimizerConfig | None = None
        self._gpt_model: torch.nn.Module | None = None
        self._megatron: MegatronState | None = None
        self._step_in_progress = False
        self._pending: ParallelConfig | None = None
        self._elastic: ElasticDriver | None = None  # with an OnNodeChange callback
        self._writer = CheckpointWriter(async_save=async_save)
        self.init_from_megatron = None if init_from_megatron is None else Path(init_from_megatron)
        #: Every switch that ran (no-ops excluded), in order; the same on every rank.
        self.switch_history: list[ReconfigReport] = []

    # ------------------------------------------------------------------------------ registry
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="megatron-core GPT with in-memory layout switches (auto layout)")

    # ---------------------------------------------------------------------------- properties
    @property
    def layout(self) -> ParallelConfig:
        """The layout training runs at now."""
        if self._layout is None:
            raise RuntimeError("DynaTrainStrategy.layout is set in setup_environment(); the Trainer has not "
                               "started this strategy yet")
        return self._layout

    @property
    def recipe(self) -> MegatronRecipe:
        if self._recipe is None:
            raise RuntimeError("no model recipe yet: the LightningModule's configure_model() must call "
                               "trainer.strategy.build_model(MegatronRecipe(...))")
        return self._recipe

    @property
    def switcher(self) -> LayoutSwitcher:
        """What every switch of this run shares (made in ``setup_environment``)."""
        assert self._switcher is not None, "setup_environment makes the switcher"
        return self._switcher

    @property
    def optimizer_settings(self) -> "AdamSettings | OptimizerConfig":
        """The optimizer settings ``configure_optimizers`` gave (megatron's ``OptimizerConfig``, or
        the GPT preset's ``AdamSettings``)."""
        assert self._optimizer_settings is not None, "setup_optimizers reads them"
        return self._optimizer_settings

    @property
    def model_shard(self) -> torch.nn.Module:
        """This rank's megatron model shard (built in ``configure_model``)."""
        assert self._gpt_model is not None, "configure_model builds it"
        return self._gpt_model

    @property
    def elastic(self) -> "ElasticDriver | None":
        """The elastic side (an ``OnNodeChange`` callback is present), else ``None``."""
        return self._elastic

    @property
    def megatron(self) -> "MegatronState":
        """The current layout's megatron state (groups, model, DDP, optimizer)."""
        if self._megatron is None:
            raise RuntimeError("megatron DDP and optimizer are built in DynaTrainStrategy.setup(); "
                               "the Trainer has not reached it")
        return self._megatron

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas and this rank's index among them, at the current layout."""
        coord = self.layout.dense_coord(self.global_rank)
        return {"num_replicas": self.layout.dp * self.layout.cp, "rank": coord.dp * self.layout.cp + coord.cp}

    # ---------------------------------------------------------------------- life cycle hooks
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # before megatron-core is first imported (init_groups): its import-time notices are named there
        quiet_third_party_warnings(on_cpu=self.root_device.type == "cpu")
        # Share the node's cores among its processes: launchers leave 1 thread each (torchrun), cores //
        # processes (Lightning's), or every core in each (fabric run, srun). See threads.py for the rule.
        threads = fit_intra_op_threads(local_processes=max(1, self.num_processes))
        if threads.message:
            rank_zero_info(threads.message)
        node_change = _node_change_callback(self._trainer())
        joined_at = None
        if node_change is not None:  # elastic: the job's store makes the worlds (strategy/elastic.py)
            reset_seed()
            self._elastic = node_change.make_driver(self)
            joined_at = self._elastic.enter(self.cluster_environment)
            self._owns_process_group = True  # its worlds are this process's to destroy
        else:
            self._setup_distributed()
        requested = self._requested_layout
        layout = joined_at or (ParallelConfig(dp=self.world_size) if requested == "auto" else requested)
        self._layout = validate_target(layout, world_size=self.world_size)
        from lightning_dynatrain.strategy.megatron_step import init_groups
        from lightning_dynatrain.strategy.topology import gather_topology

        if self._switcher is None:
            self._switcher = LayoutSwitcher(staging_budget=self.staging_budget, memory_limit=self.switch_memory_limit,
                                            verify=self.verify, promote_broadcasts=self.promote_broadcasts,
                                            switch_timeout=self.switch_timeout, training_timeout=self._timeout,
                                            resume_from=self._last_checkpoint,
                                            keep_old=self.switch_safety == "keep_old")
        self._pgs = init_groups(self._layout, seed=self.seed, groups=self._switcher.groups)
        topology = gather_topology(self.cluster_environment)
        self._switcher.new_world(topology)
        if self._elastic is not None and self._elastic.fills_model_later:
            self._switcher.world_watch()  # the next world's switch watch, where the others made theirs ahead
        rank_zero_info(f"[dynatrain] layout {self._layout} on {self.world_size} processes "
                       f"({self.process_group_backend}, {self.cluster_environment.__class__.__name__}), {topology}")

    def build_model(self, recipe: MegatronRecipe) -> torch.nn.Module:
        """Build this rank's shard of ``recipe``'s model at the current layout; call from ``configure_model``.

        A ``ModelProvider``'s description is read here (``vps.derive``, on every rank alike), and
        the module built is checked against it on every rank.

        Raises:
            LayoutError / BatchSizeError: the layout does not fit the model or the batch sizes.
            ModelSpecError: the model has a parameter no sharded description covers, or state outside
                its parameters, or shards that no layout rule explains (the message names them).
        """
        validate_target(self.layout, world_size=self.world_size, model=recipe.model,
                        global_batch_size=recipe.global_batch_size, micro_batch_size=recipe.micro_batch_size,
                        execution=recipe.execution)
        from lightning_dynatrain.strategy.megatron_step import build_checked_model

        recipe = replace(recipe, params_dtype=resolve_params_dtype(recipe.params_dtype, self.precision_plugin))
        self._recipe = recipe
        assert self._pgs is not None, "setup_environment makes the groups"
        self._gpt_model = build_checked_model(recipe, self.layout, self._pgs, rank=self.global_rank,
                                              device=self.root_device, agree=not self._collectives_are_local(),
                                              unfilled=self._elastic is not None and self._elastic.fills_model_later)
        return self._gpt_model

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if self._gpt_model is None:
            raise TypeError(
                "DynaTrainStrategy needs the megatron model built through the strategy. HINT: in "
                "LightningModule.configure_model() do `self.model = self.trainer.strategy.build_model(recipe)` "
                "(GPTLightningModule does)")
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self._start_from_megatron(trainer)
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Build megatron DDP + optimizer for the current layout from ``configure_optimizers()``: a
        ``DynaTrainOptimizer`` (in any of Lightning's forms, with learning-rate schedulers), megatron's
        ``OptimizerConfig`` (constant rate) or ``AdamSettings`` (the GPT preset's, which sets each
        step's rate itself)."""
        from megatron.core.optimizer import OptimizerConfig

        assert self.lightning_module is not None
        given = self.lightning_module.configure_optimizers()
        if isinstance(given, (AdamSettings, OptimizerConfig)):
            handle, schedulers = DynaTrainOptimizer(given), []
        else:
            super().setup_optimizers(trainer)  # Lightning's own parsing: optimizers and scheduler configs
            handles = [o for o in self.optimizers if isinstance(o, DynaTrainOptimizer)]
            if len(self.optimizers) != 1 or not handles:
                raise TypeError(
                    "under DynaTrainStrategy, configure_optimizers() returns one DynaTrainOptimizer (optionally with "
                    f"LR schedulers built on it), megatron's OptimizerConfig or AdamSettings; got {given!r}. HINT: "
                    "return DynaTrainOptimizer(OptimizerConfig(optimizer='adam', lr=...)); the strategy builds "
                    "megatron's optimizer for each layout")
            handle, schedulers = handles[0], self.lr_scheduler_configs
        from lightning_dynatrain.strategy.megatron_step import attach_optimizer

        self._optimizer_settings = given if isinstance(given, AdamSettings) else handle.config
        validate_optimizer(handle.config, self.layout)
        self.optimizers, self.lr_scheduler_configs = [handle], list(schedulers)
        assert self._pgs is not None, "setup_environment makes the groups"
        build = partial(attach_optimizer, self._gpt_model, self.recipe, self.layout, self._optimizer_settings,
                        self._pgs)
        if self._elastic is not None and self._elastic.joining:  # the state comes from the old members
            self._install(self._elastic.receive_state(build))
            self._elastic.receive_trainer_state(trainer)
        else:
            self._install(build())

    @property
    def optimizer_handle(self) -> DynaTrainOptimizer:
        """The optimizer Lightning steps (its schedule group holds the rate the next step uses)."""
        handle = self.optimizers[0] if self.optimizers else None
        assert isinstance(handle, DynaTrainOptimizer), "setup_optimizers makes it"
        return handle

    def _install(self, state: "MegatronState") -> None:
        """Make ``state`` the one training runs on: the module's ``model``, Lightning's optimizer handle.

        The one place that points Lightning at a layout's megatron objects (setup and every switch).
        The state it replaces is taken apart (``release_state``: nothing may use it afterwards).
        """
        old, self._megatron = self._megatron, state
        self._gpt_model = state.model
        self._layout = state.layout
        module = self.lightning_module
        if module is not None and getattr(module, "model", None) is not state.model:
            module.model = state.model
        self.optimizer_handle.rebind(state)
        if old is not None and old is not state:
            from lightning_dynatrain.megatron.state import release_state

            release_state(old)

    @override
    def on_train_start(self) -> None:
        if self._elastic is not None:
            self._elastic.end_catching_up()
        # The data position is global_step * G: align every global-batch sampler (matters on resume).
        trainer = self._trainer()
        if trainer is not None:
            for sampler in global_batch_samplers(trainer.train_dataloader):
                sampler.set_step(trainer.global_step)

    @override
    def teardown(self) -> None:
        if dist.is_available() and dist.is_initialized():
            self._writer.close()  # a background save completes before its groups go
        if self._switcher is not None and dist.is_available() and dist.is_initialized():
            from lightning_dynatrain.strategy.megatron_step import teardown_state

            teardown_state()
            self._switcher.close()
        self._megatron = None
        self._pending = None
        if self._elastic is not None:
            self._elastic.close()
        self._teardown_process_group()
        super().teardown()

    def __repr__(self) -> str:
        layout = self._layout or self._requested_layout
        return f"DynaTrainStrategy(layout={str(layout)!r}, staging_budget={self.staging_budget})"


def _node_change_callback(trainer: "pl.Trainer | None") -> "OnNodeChange | None":
    """The trainer's ``OnNodeChange`` callback (it makes the run elastic), if any."""
    from lightning_dynatrain.callbacks.node_change import OnNodeChange

    found = [c for c in (trainer.callbacks if trainer is not None else []) if isinstance(c, OnNodeChange)]
    return found[0] if found else None


__all__ = ["DynaTrainStrategy"]


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    DynaTrainStrategy.register_strategies(StrategyRegistry)


_register()  # Trainer(strategy="dynatrain"); see lightning_dynatrain/__init__.py for when this runs
