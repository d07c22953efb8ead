"""``DynaTrainStrategy``: Lightning training of a megatron-core GPT whose parallel layout can change in memory.

The strategy owns megatron's side of training for the current layout (groups, model shard, megatron
DDP and optimizer, pipeline schedule; one ``MegatronState``) and gives Lightning what it expects
(ranks, a device, an optimizer to count steps, collectives, checkpoints). Hooks are thin; the work
is in plain functions (``megatron_step``, ``validation``, ``report``, ``checkpoint``).

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
rebuild. ``is_distributed`` is ``False`` for that reason: Lightning then injects no
``DistributedSampler`` (which would fix the dp size when built) and ``self.log(sync_dist=True)`` does
not reduce; the loss the strategy returns is already the same on every rank.

Layout switches (``reconfigure``, ``switching.py``) run at the optimizer-step boundary; a request made
during a training step is deferred to the end of that step.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dynatrain.data.sampler import GlobalBatchSampler
from lightning_dynatrain.strategy.checkpoint import load_rank_checkpoint, save_rank_checkpoint
from lightning_dynatrain.strategy.config import AdamSettings, MegatronRecipe
from lightning_dynatrain.strategy.optimizer_handle import MegatronOptimizerHandle
from lightning_dynatrain.strategy.precision import MegatronPrecision, megatron_precision, resolve_params_dtype
from lightning_dynatrain.strategy.report import ReconfigReport
from lightning_dynatrain.strategy.switching import LayoutSwitching
from lightning_dynatrain.strategy.threads import fit_intra_op_threads
from lightning_dynatrain.strategy.validation import WorldSizeError, validate_target
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.warning_filters import quiet_third_party_warnings

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dynatrain.strategy.megatron_step import MegatronState


def _parse_budget(value: int | str) -> int:
    from lightning_dynatrain.engine.staging import parse_bytes

    return parse_bytes(value)


class DynaTrainStrategy(LayoutSwitching, ParallelStrategy):
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
        timeout: timeout of collectives (``init_process_group``).
        cluster_environment: Lightning's cluster environment; ``None`` lets the Trainer detect it.
        seed: seed of megatron's RNG trackers (model weights are seeded by the module's recipe).
        parallel_devices, checkpoint_io: as for any Lightning ``ParallelStrategy``.
        precision_plugin: leave it out and pass ``Trainer(precision="bf16-mixed" | "32-true")``: the
            strategy runs megatron's own mixed precision (``strategy.precision``), never autocast.

    Raises:
        LayoutError: ``layout`` cannot be parsed (at construction) or does not fit the world or the
            model (at ``setup_environment`` / ``configure_model``).
        StagingBudgetError: ``staging_budget`` or ``switch_memory_limit`` is not a byte count.
        SwitchMemoryError: (at a switch) it would not fit in memory, or exceed ``switch_memory_limit``;
            nothing was moved and training can go on at the old layout.
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
        timeout: timedelta = timedelta(minutes=30),
        cluster_environment: ClusterEnvironment | None = None,
        seed: int = 1234,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=None, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._requested_layout: ParallelConfig | Literal["auto"] = (
            "auto" if isinstance(layout, str) and layout.strip().lower() == "auto" else ParallelConfig.parse(layout))
        self.staging_budget = _parse_budget(staging_budget)
        self.switch_memory_limit = None if switch_memory_limit is None else _parse_budget(switch_memory_limit)
        self.verify = verify
        self.seed = seed
        self.num_nodes = 1
        self._backend = backend
        self._timeout = timeout
        self._layout: ParallelConfig | None = None
        self._owns_process_group = False
        # megatron's process groups of every layout this run has used (a ``ProcessGroupCache``, made
        # at setup: megatron is imported only then); switching back to a layout costs no group work
        self._groups: Any = None
        self._recipe: MegatronRecipe | None = None
        self._adam: AdamSettings | None = None
        self._gpt_model: torch.nn.Module | None = None
        self._megatron: MegatronState | None = None
        self._step_in_progress = False
        self._pending: ParallelConfig | None = None
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
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def precision_plugin(self) -> MegatronPrecision:
        """Megatron's own mixed precision, as ``Trainer(precision=...)`` asked (``strategy.precision``)."""
        return self._precision_plugin if self._precision_plugin is not None else MegatronPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # None stays None until the Trainer sets its plugin: Lightning reads a strategy's own plugin
        # as the user's choice and would then ignore Trainer(precision=...)
        self._precision_plugin = None if plugin is None else megatron_precision(plugin)

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str:
        return self._backend or _get_default_process_group_backend_for_device(self.root_device)

    @property
    def is_distributed(self) -> bool:
        """``False`` on purpose: the data is global batches on every rank (see module docstring)."""
        return False

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
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # before megatron-core is first imported (init_groups): its import-time notices are named there
        quiet_third_party_warnings(on_cpu=self.root_device.type == "cpu")
        self._setup_distributed()
        # Share the node's cores among its processes: launchers leave 1 thread each (torchrun), cores //
        # processes (Lightning's), or every core in each (fabric run, srun). See threads.py for the rule.
        threads = fit_intra_op_threads(local_processes=max(1, self.num_processes))
        if threads.message:
            rank_zero_info(threads.message)
        requested = self._requested_layout
        layout = ParallelConfig(dp=self.world_size) if requested == "auto" else requested
        self._layout = validate_target(layout, world_size=self.world_size)
        from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache
        from lightning_dynatrain.strategy.megatron_step import init_groups

        if self._groups is None:
            self._groups = ProcessGroupCache()
        init_groups(self._layout, seed=self.seed, groups=self._groups)
        rank_zero_info(f"[dynatrain] layout {self._layout} on {self.world_size} processes "
                       f"({self.process_group_backend}, {self.cluster_environment.__class__.__name__})")

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise WorldSizeError(
                    f"torch.distributed is already initialised with {dist.get_world_size()} ranks but Lightning "
                    f"sees {self.world_size}", hint="pass Trainer(devices=..., num_nodes=...) matching the job")
            return  # someone else owns the group (a test harness, an outer script): leave it to them
        _init_dist_connection(self.cluster_environment, self.process_group_backend, timeout=self._timeout)
        self._owns_process_group = True

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def build_model(self, recipe: MegatronRecipe) -> torch.nn.Module:
        """Build this rank's shard of ``recipe``'s GPT at the current layout; call from ``configure_model``.

        Raises:
            LayoutError / BatchSizeError: the layout does not fit the model or the batch sizes.
        """
        validate_target(self.layout, world_size=self.world_size, shape=recipe.shape,
                        global_batch_size=recipe.global_batch_size, micro_batch_size=recipe.micro_batch_size)
        from lightning_dynatrain.strategy.megatron_step import build_model

        recipe = replace(recipe, params_dtype=resolve_params_dtype(recipe.params_dtype, self.precision_plugin))
        self._recipe = recipe
        self._gpt_model = build_model(recipe, self.layout, device=self.root_device)
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
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Build megatron DDP + optimizer for the current layout from ``configure_optimizers()``'s ``AdamSettings``."""
        assert self.lightning_module is not None
        adam = self.lightning_module.configure_optimizers()
        if not isinstance(adam, AdamSettings):
            raise TypeError(
                f"under DynaTrainStrategy, configure_optimizers() returns AdamSettings, got {type(adam).__name__}. "
                "HINT: return AdamSettings(lr=..., weight_decay=...); the strategy builds megatron's optimizer "
                "for each layout")
        from lightning_dynatrain.strategy.megatron_step import attach_optimizer

        self._adam = adam
        self._install(attach_optimizer(self._gpt_model, self.recipe, self.layout, adam))

    def _install(self, state: "MegatronState") -> None:
        """Make ``state`` the one training runs on: the module's ``model``, Lightning's optimizer handle.

        The one place that points Lightning at a layout's megatron objects (setup and every switch).
        """
        self._megatron = state
        self._gpt_model = state.model
        self._layout = state.layout
        module = self.lightning_module
        if module is not None and getattr(module, "model", None) is not state.model:
            module.model = state.model
        if self._optimizers and isinstance(self._optimizers[0], MegatronOptimizerHandle):
            self._optimizers[0].rebind(state)
        else:
            self.optimizers = [MegatronOptimizerHandle(state)]
        self.lr_scheduler_configs = []

    @override
    def model_to_device(self) -> None:
        pass  # build_model puts the shard on root_device

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Not Lightning's default (root_device as the default device): megatron builds on CPU
        # (use_cpu_initialization, CPU generators for the layout-free init) and build_model moves the
        # shard to root_device afterwards; a CUDA default device breaks those CPU draws.
        with self.precision_plugin.tensor_init_context():
            yield

    @override
    def on_train_start(self) -> None:
        # The data position is global_step * G: align every global-batch sampler (matters on resume).
        trainer = self._trainer()
        if trainer is not None:
            for sampler in _global_batch_samplers(trainer.train_dataloader):
                sampler.set_step(trainer.global_step)

    @override
    def teardown(self) -> None:
        if self._megatron is not None or self._layout is not None:
            from lightning_dynatrain.strategy.megatron_step import teardown_state

            if dist.is_available() and dist.is_initialized():
                teardown_state(self._groups)
        self._megatron = None
        self._pending = None
        if self._owns_process_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False
        super().teardown()

    # ----------------------------------------------------------------------- the train step
    def train_step(self, batch: Mapping[str, torch.Tensor], *, lr: float, weight_decay: float | None = None) -> float:
        """One optimizer step over the global ``batch`` (call from ``training_step``); the global mean loss.

        Lightning counts it as an optimizer step (``trainer.global_step`` advances).
        """
        from lightning_dynatrain.strategy.megatron_step import train_step

        state = self.megatron
        closure = partial(train_step, state, batch, global_batch_size=self.recipe.global_batch_size, lr=lr,
                          weight_decay=self._adam.weight_decay if weight_decay is None else weight_decay)
        return self._lightning_optimizers[0].step(closure=closure)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._step_in_progress = True
        try:
            output = super().training_step(*args, **kwargs)
        finally:
            self._step_in_progress = False
        self._run_pending()  # a switch requested during the step runs now, at the boundary
        return output

    def _trainer(self) -> "pl.Trainer | None":
        module = self.lightning_module
        return getattr(module, "_trainer", None) if module is not None else None

    def _global_step(self) -> int:
        trainer = self._trainer()
        return trainer.global_step if trainer is not None else 0

    # --------------------------------------------------------------------------- collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: torch.Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> torch.Tensor | Any:
        """Reduce over the current layout's data-parallel group (``group=None``), or over ``group``."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if group is None and self._megatron is not None:
            group = self._megatron.groups.dp_cp
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree over every process (not only data-parallel replicas): stopping is a job-wide decision."""
        value = torch.tensor(int(decision), device=self.root_device)
        value = _sync_ddp_if_available(value, None, reduce_op=ReduceOp.SUM)
        return bool(value == self.world_size) if all else bool(value)

    # --------------------------------------------------------------------------- checkpoints
    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return optimizer.state_dict()  # this rank's shard, on every rank

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        """Every rank writes its own file under ``filepath`` (a directory); see ``strategy.checkpoint``."""
        if storage_options is not None:
            raise TypeError("DynaTrainStrategy.save_checkpoint does not take storage_options")
        save_rank_checkpoint(checkpoint, filepath, rank=self.global_rank, layout=self.layout,
                             world_size=self.world_size)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        return load_rank_checkpoint(checkpoint_path, rank=self.global_rank, layout=self.layout,
                                    world_size=self.world_size, weights_only=weights_only)

    def __repr__(self) -> str:
        layout = self._layout or self._requested_layout
        return f"DynaTrainStrategy(layout={str(layout)!r}, staging_budget={self.staging_budget})"


def _global_batch_samplers(loaders: Any) -> Iterator[GlobalBatchSampler]:
    """Every ``GlobalBatchSampler`` in a dataloader or a (nested) collection of them."""
    if isinstance(loaders, DataLoader):
        if isinstance(loaders.batch_sampler, GlobalBatchSampler):
            yield loaders.batch_sampler
    elif isinstance(loaders, Mapping):
        for value in loaders.values():
            yield from _global_batch_samplers(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from _global_batch_samplers(value)


__all__ = ["DynaTrainStrategy"]


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    DynaTrainStrategy.register_strategies(StrategyRegistry)


_register()  # Trainer(strategy="dynatrain"); see lightning_dynatrain/__init__.py for when this runs
