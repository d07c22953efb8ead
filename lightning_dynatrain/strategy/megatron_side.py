"""``MegatronSide``: the megatron-core objects ``DynaTrainStrategy`` trains on, built across Lightning's
hooks and replaced by every switch.

``DynaTrainStrategy`` owns one and hands it the megatron work of its set-up hooks, the steps
``megatron_step.build_training_state`` runs in one call, here spread over the hooks:

- ``setup_environment``: the starting layout checked against the world, its groups and the world's
  topology (``start``); the ``switching.LayoutSwitcher`` every switch shares is made then, and keeps
  the groups of every layout used, so switching back to a layout costs no group work;
- ``configure_model``: this rank's model shard (``build_model``, which the LightningModule calls);
- ``setup_optimizers``: the optimizer settings (``take_optimizer_settings``), then megatron DDP and
  optimizer, or for a process joining an elastic run the state the old members send (``build_optimizer``).

The current layout's state is one ``MegatronState``: ``install`` makes a new one current (at set-up,
every switch, every world change) and ``check_layout`` checks a switch's target against what runs
now; ``close`` takes megatron's groups down at teardown. The strategy's properties (``layout``,
``recipe``, ``megatron``, ``groups``, ...) read it all here; the work is in ``megatron_step``'s plain
functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dynatrain.strategy.config import AdamSettings, MegatronRecipe, optimizer_config
from lightning_dynatrain.strategy.joining import receive_state, receive_trainer_state
from lightning_dynatrain.strategy.precision import resolve_params_dtype
from lightning_dynatrain.strategy.switching import LayoutSwitcher
from lightning_dynatrain.strategy.validation import validate_optimizer, validate_target
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from megatron.core.optimizer import OptimizerConfig

    from megatron.core.process_groups_config import ProcessGroupCollection

    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy
    from lightning_dynatrain.strategy.optimizer_handle import DynaTrainOptimizer


class MegatronSide:
    """The megatron objects of ``DynaTrainStrategy``'s run (see the module docstring).

    Args:
        strategy: the strategy it builds for; read: its ranks and world, ``root_device``,
            ``precision_plugin``, ``seed``, its switch settings (``staging_budget``,
            ``switch_memory_limit``, ``verify``, ``promote_broadcasts``, ``switch_timeout``,
            ``switch_safety``), ``checkpointing``, ``elastic``, ``cluster_environment``,
            ``lightning_module`` and ``optimizer_handle``.
        local_collectives: whether the collectives Lightning asks for are local no-ops now (the
            strategy's ``_collectives_are_local``).
        training_timeout: the process groups' timeout outside switches (the strategy's ``timeout``).
    """

    def __init__(self, strategy: "DynaTrainStrategy", *, local_collectives: Callable[[], bool],
                 training_timeout: timedelta) -> None:
        self._strategy = strategy
        self._local_collectives = local_collectives
        self._training_timeout = training_timeout
        self._switcher: LayoutSwitcher | None = None
        self._layout: ParallelConfig | None = None
        self._groups: ProcessGroupCollection | None = None  # the starting layout's, for the model shard
        self._recipe: MegatronRecipe | None = None
        self._optimizer_settings: AdamSettings | OptimizerConfig | None = None
        self._model: torch.nn.Module | None = None
        self._state: MegatronState | None = None

    # ---------------------------------------------------------------------------- what runs now
    @property
    def layout(self) -> ParallelConfig:
        """The layout training runs at now."""
        if self._layout is None:
            raise RuntimeError("DynaTrainStrategy.layout is set in setup_environment(); the Trainer has not "
                               "started this strategy yet")
        return self._layout

    @property
    def layout_or_none(self) -> ParallelConfig | None:
        """``layout``, or ``None`` before ``setup_environment``."""
        return self._layout

    @property
    def recipe(self) -> MegatronRecipe:
        """The model's recipe ``build_model`` was given (its ``params_dtype`` resolved)."""
        if self._recipe is None:
            raise RuntimeError("no model recipe yet: the LightningModule's configure_model() must call "
                               "trainer.strategy.build_model(MegatronRecipe(...))")
        return self._recipe

    @property
    def recipe_or_none(self) -> MegatronRecipe | None:
        """``recipe``, or ``None`` before ``configure_model`` gave one."""
        return self._recipe

    @property
    def switcher(self) -> LayoutSwitcher:
        """What every switch of this run shares (made in ``start``)."""
        assert self._switcher is not None, "setup_environment makes the switcher"
        return self._switcher

    @property
    def optimizer_settings(self) -> "AdamSettings | OptimizerConfig":
        """The optimizer settings ``configure_optimizers`` gave."""
        assert self._optimizer_settings is not None, "setup_optimizers reads them"
        return self._optimizer_settings

    @property
    def model_shard(self) -> torch.nn.Module:
        """This rank's megatron model shard (built in ``configure_model``)."""
        assert self._model is not None, "configure_model builds it"
        return self._model

    @property
    def state(self) -> "MegatronState":
        """The current layout's megatron state (groups, model, DDP, optimizer)."""
        if self._state is None:
            raise RuntimeError("megatron DDP and optimizer are built in DynaTrainStrategy.setup(); "
                               "the Trainer has not reached it")
        return self._state

    @property
    def state_or_none(self) -> "MegatronState | None":
        """``state``, or ``None`` before ``setup`` built it (a ``validate`` run builds none)."""
        return self._state

    @property
    def groups(self) -> "ProcessGroupCollection":
        """Megatron's groups of the current layout: the state's, or before ``setup`` built it, those
        ``start`` made for the model shard."""
        if self._state is not None:
            return self._state.groups
        assert self._groups is not None, "setup_environment makes the groups"
        return self._groups

    # ------------------------------------------------------------------------------ set-up
    def start(self, layout: ParallelConfig | Literal["auto"]) -> None:
        """Check the starting ``layout`` (``"auto"``: data parallelism over every process) against the
        world and make its groups, the switcher (once) and the world's topology; from
        ``setup_environment``, once the world is up."""
        strategy = self._strategy
        if layout == "auto":
            layout = ParallelConfig(dp=strategy.world_size)
        self._layout = validate_target(layout, world_size=strategy.world_size)
        from lightning_dynatrain.strategy.megatron_step import init_groups
        from lightning_dynatrain.strategy.topology import gather_topology

        if self._switcher is None:
            self._switcher = self._make_switcher()
        self._groups = init_groups(self._layout, seed=strategy.seed, groups=self._switcher.groups)
        topology = gather_topology(strategy.cluster_environment)
        self._switcher.new_world(topology)
        if strategy.elastic is not None and strategy.elastic.fills_model_later:
            self._switcher.world_watch()  # the next world's switch watch, where the others made theirs ahead
        rank_zero_info(f"[dynatrain] layout {self._layout} on {strategy.world_size} processes "
                       f"({strategy.process_group_backend}, {strategy.cluster_environment.__class__.__name__}), "
                       f"{topology}")

    def _make_switcher(self) -> LayoutSwitcher:
        """The switcher, from the strategy's switch settings."""
        strategy = self._strategy
        return LayoutSwitcher(staging_budget=strategy.staging_budget, memory_limit=strategy.switch_memory_limit,
                              verify=strategy.verify, promote_broadcasts=strategy.promote_broadcasts,
                              switch_timeout=strategy.switch_timeout, training_timeout=self._training_timeout,
                              resume_from=strategy.checkpointing.latest_path,
                              keep_old=strategy.switch_safety == "keep_old")

    def build_model(self, recipe: MegatronRecipe) -> torch.nn.Module:
        """Build this rank's shard of ``recipe``'s model at the current layout (``configure_model``).

        A ``ModelProvider``'s description is read here (``vps.derive``, on every rank alike), and
        the module built is checked against it on every rank.

        Raises:
            LayoutError / BatchSizeError: the layout does not fit the model or the batch sizes.
            ModelSpecError: the model has a parameter no sharded description covers, or state outside
                its parameters, or shards that no layout rule explains (the message names them).
        """
        strategy = self._strategy
        validate_target(self.layout, world_size=strategy.world_size, model=recipe.model,
                        global_batch_size=recipe.global_batch_size, micro_batch_size=recipe.micro_batch_size,
                        execution=recipe.execution)
        from lightning_dynatrain.strategy.megatron_step import build_checked_model

        recipe = replace(recipe, params_dtype=resolve_params_dtype(recipe.params_dtype, strategy.precision_plugin))
        self._recipe = recipe
        assert self._groups is not None, "setup_environment makes the groups"
        elastic = strategy.elastic
        self._model = build_checked_model(recipe, self.layout, self._groups, rank=strategy.global_rank,
                                          device=strategy.root_device, agree=not self._local_collectives(),
                                          unfilled=elastic is not None and elastic.fills_model_later)
        return self._model

    def check_model_built(self) -> None:
        """Raise ``TypeError`` unless the model shard was built through ``build_model`` (``setup``)."""
        if self._model is None:
            raise TypeError(
                "DynaTrainStrategy needs the megatron model built through the strategy. HINT: in "
                "LightningModule.configure_model() do `self.model = self.trainer.strategy.build_model(recipe)` "
                "(GPTLightningModule does)")

    def take_optimizer_settings(self, given: Any, handle: "DynaTrainOptimizer") -> None:
        """Keep the settings ``configure_optimizers`` gave (``given`` when it is the GPT preset's
        ``AdamSettings``, else the ``handle``'s config), once checked against the current layout."""
        self._optimizer_settings = given if isinstance(given, AdamSettings) else handle.config
        validate_optimizer(handle.config, self.layout)

    def build_optimizer(self, trainer: "pl.Trainer") -> None:
        """Megatron DDP and optimizer around the model shard, installed; a process joining an elastic
        run receives them, and the trainer's state, from the old members instead."""
        from lightning_dynatrain.strategy.megatron_step import attach_optimizer

        assert self._groups is not None, "setup_environment makes the groups"
        build = partial(attach_optimizer, self._model, self.recipe, self.layout, self._optimizer_settings,
                        self._groups)
        elastic = self._strategy.elastic
        if elastic is not None and elastic.joining:  # the state comes from the old members
            self.install(receive_state(elastic, build))
            receive_trainer_state(elastic, trainer)
        else:
            self.install(build())

    # ------------------------------------------------------------------- switches, teardown
    def install(self, state: "MegatronState") -> None:
        """Make ``state`` the one training runs on: the module's ``model``, Lightning's optimizer handle.

        The one place that points Lightning at a layout's megatron objects (setup and every switch).
        The state it replaces is taken apart (``release_state``: nothing may use it afterwards).
        """
        old, self._state = self._state, state
        self._model = state.model
        self._layout = state.layout
        module = self._strategy.lightning_module
        if module is not None and getattr(module, "model", None) is not state.model:
            module.model = state.model
        self._strategy.optimizer_handle.rebind(state)
        if old is not None and old is not state:
            from lightning_dynatrain.megatron.state import release_state

            release_state(old)

    def check_layout(self, target: str | ParallelConfig) -> ParallelConfig:
        """Parse and check ``target`` against the world, the model, the batch and the optimizer; the
        layout or a typed error."""
        recipe = self._recipe
        layout = validate_target(target, world_size=self._strategy.world_size, current=self._layout,
                                 model=recipe.model if recipe else None,
                                 global_batch_size=recipe.global_batch_size if recipe else None,
                                 micro_batch_size=recipe.micro_batch_size if recipe else None,
                                 execution=recipe.execution if recipe else None)
        if self._optimizer_settings is not None:
            validate_optimizer(optimizer_config(self._optimizer_settings), layout)
        return layout

    def close(self) -> None:
        """Megatron's groups and the switcher's go (while the world is up); the state is dropped."""
        if self._switcher is not None and dist.is_available() and dist.is_initialized():
            from lightning_dynatrain.strategy.megatron_step import teardown_state

            teardown_state()
            self._switcher.close()
        self._state = None


__all__ = ["MegatronSide"]
