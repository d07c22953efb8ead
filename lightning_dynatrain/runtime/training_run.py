"""``TrainingRun``: one run's megatron training at its current layout, the same under every front end.

The Lightning strategy and the loop engine (Fabric, Accelerate) each hold one ``TrainingRun`` and
call it in the same order; what differs between them is only when they call it and what they tell
their library afterwards:

1. ``start(layout, world_size=, node_rank=)``: the starting layout checked against the world, its
   megatron groups, the world's topology; the run's ``LayoutSwitcher`` is made then, from the
   settings (``LayoutSwitcher.from_settings``), and keeps every layout's groups;
2. ``build_model(recipe, rank=, device=)``: this rank's model shard, checked against its description;
3. ``set_optimizer(settings)``, then ``install(build_state())``: megatron DDP and optimizer;
4. every step: ``train_step(batch, lr=, weight_decay=)`` (``eval_step`` forward only);
5. a switch: ``check(target)`` (the one check of a switch request: the world, the model, the batch
   and the optimizer, refused before anything moves with a typed error), then
   ``switch(layout, step=)`` or, ahead of it, ``prepare(layout)``;
6. between two steps, ``with rollout(layout, park=, keep_weights=) as policy:`` the training
   weights at another layout for generation (``runtime.rollout``); no step, switch or build ahead
   runs meanwhile (each is refused with ``RolloutError``);
7. ``close()`` at the end, while the world is up.

``install`` is the one place a layout's ``MegatronState`` becomes the one training runs on (set-up,
every switch, every world change and recovery); the front end's ``on_install`` (given at
construction) points its library at the new objects, and the state replaced is taken apart.

Example (every rank; the loop engine's set-up)::

    run = TrainingRun(settings, warn=print)
    run.start(settings.start_layout(world), world_size=world, node_rank=0)
    run.build_model(recipe, rank=rank, device=device)
    run.set_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3))
    run.install(run.build_state())
    loss = run.train_step(batch, lr=1e-3, weight_decay=0.0)
    report = run.switch(run.check("dp1-tp2-pp2"), step=1)
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from lightning_dynatrain.runtime.layout_checks import layout_microbatches, validate_optimizer, validate_target
from lightning_dynatrain.runtime.reconfig_report import ReconfigReport
from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe, optimizer_config
from lightning_dynatrain.runtime.rollout import RolloutError, RolloutFigures, RolloutPolicy
from lightning_dynatrain.transition.errors import mark_freed, mark_refused
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.megatron.step_progress import StepProgress
    from lightning_dynatrain.runtime.settings import DynaTrainSettings
    from lightning_dynatrain.runtime.switcher import LayoutSwitcher
    from lightning_dynatrain.vps.topology import Topology


class TrainingRun:
    """The megatron side of a run (see the module docstring).

    Args:
        settings: the run's settings (the seed of megatron's RNG trackers, the switch budgets).
        training_timeout: the process groups' timeout outside switches.
        resume_from: says the run's latest checkpoint (a failed switch names it to resume from).
        warn: how the run warns the user (the front end's rank-zero warning).
        on_install: called with each state ``install`` makes current, before the old one is taken
            apart (the front end points its library at it: a LightningModule's ``model``, an
            optimizer handle).
    """

    def __init__(self, settings: "DynaTrainSettings", *, training_timeout: timedelta = timedelta(minutes=30),
                 resume_from: Callable[[], str | None] = lambda: None,
                 warn: Callable[[str], None] = warnings.warn,
                 on_install: Callable[["MegatronState"], None] = lambda state: None) -> None:
        self.settings = settings
        self._training_timeout, self._resume_from, self._warn = training_timeout, resume_from, warn
        self._on_install = on_install
        self._switcher: LayoutSwitcher | None = None
        self._layout: ParallelConfig | None = None
        self._groups: ProcessGroupCollection | None = None  # the current layout's (``start``'s before a state)
        self._recipe: MegatronRecipe | None = None
        self._optimizer: AdamSettings | OptimizerConfig | None = None
        self._model: torch.nn.Module | None = None
        self._state: MegatronState | None = None
        self._rollout: RolloutPolicy | None = None  # the rollout phase running, if any
        self._stepping = False  # inside ``train_step``

    # ---------------------------------------------------------------------------- what runs now
    @property
    def seed(self) -> int:
        """The seed of megatron's RNG trackers."""
        return self.settings.seed

    @property
    def layout(self) -> ParallelConfig:
        """The layout training runs at now."""
        if self._layout is None:
            raise RuntimeError("the run's layout is set in setup_environment() (DynaTrainStrategy) or the DynaTrainEngine "
                               "constructor: the run has not started yet")
        return self._layout

    @property
    def layout_or_none(self) -> ParallelConfig | None:
        """``layout``, or ``None`` before ``start``."""
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
        """``recipe``, or ``None`` before ``build_model``."""
        return self._recipe

    @property
    def optimizer_settings(self) -> "AdamSettings | OptimizerConfig":
        """The optimizer settings every layout's optimizer is built from (``set_optimizer``)."""
        assert self._optimizer is not None, "set_optimizer gives them"
        return self._optimizer

    @property
    def optimizer_settings_or_none(self) -> "AdamSettings | OptimizerConfig | None":
        return self._optimizer

    @property
    def switcher(self) -> "LayoutSwitcher":
        """What every switch of this run shares (made in ``start``)."""
        assert self._switcher is not None, "start() makes the switcher"
        return self._switcher

    @property
    def model_shard(self) -> torch.nn.Module:
        """This rank's megatron model shard (``build_model``; replaced by every switch)."""
        assert self._model is not None, "build_model builds it"
        return self._model

    @property
    def model_shard_or_none(self) -> torch.nn.Module | None:
        return self._model

    @property
    def state(self) -> "MegatronState":
        """The current layout's megatron state (groups, model, DDP, optimizer)."""
        if self._state is None:
            raise RuntimeError("megatron DDP and optimizer are built in DynaTrainStrategy.setup() (or the DynaTrainEngine "
                               "constructor): not yet, or the run was closed")
        return self._state

    @property
    def state_or_none(self) -> "MegatronState | None":
        """``state``, or ``None`` before it is built (a ``validate`` run builds none) or after ``close``."""
        return self._state

    @property
    def groups(self) -> "ProcessGroupCollection":
        """Megatron's groups of the current layout: the state's, or before it is built, those ``start`` made."""
        if self._state is not None:
            return self._state.groups
        assert self._groups is not None, "start() makes the groups"
        return self._groups

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step at the current layout: global // (dp * micro)."""
        return layout_microbatches(self.recipe.global_batch_size, self.recipe.micro_batch_size, self.layout)

    # ------------------------------------------------------------------------------ set-up
    def start(self, layout: ParallelConfig | Literal["auto"], *, world_size: int, node_rank: int) -> "Topology":
        """Check the starting ``layout`` (``"auto"``: data parallelism over every process) against the
        world, make its groups, the switcher (once) and the world's topology; collective over the
        world (a new world after a world change calls it again). Returns the topology."""
        from lightning_dynatrain.runtime.switcher import LayoutSwitcher
        from lightning_dynatrain.runtime.training_state import init_groups
        from lightning_dynatrain.runtime.world_topology import gather_topology

        if layout == "auto":
            layout = ParallelConfig(dp=world_size)
        self._layout = validate_target(layout, world_size=world_size)
        if self._switcher is None:
            self._switcher = LayoutSwitcher.from_settings(self.settings, training_timeout=self._training_timeout,
                                                          resume_from=self._resume_from, warn=self._warn)
        self._groups = init_groups(self._layout, seed=self.seed, groups=self._switcher.groups)
        topology = gather_topology(node_rank)
        self._switcher.new_world(topology)
        return topology

    def build_model(self, recipe: MegatronRecipe, *, rank: int, device: torch.device | None = None,
                    agree: bool = True, unfilled: bool = False) -> torch.nn.Module:
        """This rank's shard of ``recipe``'s model at the current layout (its ``params_dtype`` resolved
        by the front end). A ``ModelProvider``'s description is read here (on every rank alike) and
        the module built is checked against it (collective with ``agree``; ``unfilled``: built
        without initial values, for a switch to fill).

        Raises:
            LayoutError / BatchSizeError: the layout does not fit the model or the batch sizes.
            ModelSpecError: the model has a parameter no sharded description covers, or state outside
                its parameters, or shards that no layout rule explains (the message names them).
        """
        from lightning_dynatrain.runtime.training_state import build_checked_model

        validate_target(self.layout, world_size=self.layout.world_size, model=recipe.model,
                        global_batch_size=recipe.global_batch_size, micro_batch_size=recipe.micro_batch_size,
                        execution=recipe.execution)
        self._recipe = recipe
        assert self._groups is not None, "start() makes the groups"
        self._model = build_checked_model(recipe, self.layout, self._groups, rank=rank, device=device, agree=agree,
                                          unfilled=unfilled)
        return self._model

    def set_optimizer(self, settings: "AdamSettings | OptimizerConfig") -> None:
        """The optimizer settings every layout's optimizer is built from, checked against the current
        layout (``LayoutError``: zero1 with an optimizer megatron's distributed optimizer does not take)."""
        validate_optimizer(optimizer_config(settings), self.layout)
        self._optimizer = settings

    def build_state(self) -> "MegatronState":
        """Megatron DDP and optimizer around the model shard (not installed: ``install`` it)."""
        from lightning_dynatrain.runtime.training_state import attach_optimizer

        assert self._groups is not None, "start() makes the groups"
        return attach_optimizer(self.model_shard, self.recipe, self.layout, self.optimizer_settings, self._groups)

    def install(self, state: "MegatronState") -> None:
        """Make ``state`` the one training runs on (set-up, every switch, world change and recovery):
        the front end's ``on_install`` points its library at it, then the state it replaces is taken
        apart (``release_state``: nothing may use it afterwards)."""
        old, self._state = self._state, state
        self._model, self._layout, self._groups = state.model, state.layout, state.groups  # the old layout's go
        self._on_install(state)
        if old is not None and old is not state:
            from lightning_dynatrain.megatron.state import release_state

            release_state(old)

    # ---------------------------------------------------------------------------- switches
    def check(self, target: str | ParallelConfig) -> ParallelConfig:
        """The one check of a switch request, the same under every front end: ``target`` parsed and
        checked against the world, the model, the batch and the optimizer. Returns the layout.

        Raises (each marked refused, ``transition.errors.was_refused``: nothing moved):
            LayoutError: the target is malformed, does not fit the model, or zero1 with an optimizer
                megatron's distributed optimizer does not take (the message names the rule).
            WorldSizeError: the target needs a different number of processes.
            BatchSizeError: the global batch does not split into micro-batches at the target.
        """
        recipe = self._recipe
        try:
            self._refuse_in_rollout("a layout switch")
            layout = validate_target(target, world_size=self.layout.world_size,
                                     current=self._layout, model=recipe.model if recipe else None,
                                     global_batch_size=recipe.global_batch_size if recipe else None,
                                     micro_batch_size=recipe.micro_batch_size if recipe else None,
                                     execution=recipe.execution if recipe else None)
            if self._optimizer is not None:
                validate_optimizer(optimizer_config(self._optimizer), layout)
        except DynaTrainError as err:
            raise mark_refused(err)
        return layout

    def switch(self, layout: ParallelConfig, *, step: int, deferred: bool = False) -> ReconfigReport:
        """Move every piece of training state to the checked ``layout`` and install it (collective:
        every rank, the same layout, between the same two steps); the switch's report (a no-op
        report when ``layout`` runs already).

        Raises:
            SwitchMemoryError, StagingBudgetError: the switch does not fit (refused: nothing moved).
            SwitchFailedError: a rank died or stalled, or a wait ran past the deadline.
        """
        if layout == self.layout:
            return ReconfigReport(step=step, src=str(layout), dst=str(layout), deferred=deferred)
        state, report = self.switcher.switch(self.state, layout, recipe=self.recipe, optimizer=self.optimizer_settings,
                                             step=step, deferred=deferred)
        self.install(state)
        return report

    def prepare(self, layout: ParallelConfig) -> bool:
        """Start building the switch to the checked ``layout`` in the background (``LayoutSwitcher.prepare``);
        whether a build started. Collective (every rank, between the same two steps)."""
        self._refuse_in_rollout("a switch built ahead")
        return self.switcher.prepare(self.state, layout, recipe=self.recipe, optimizer=self.optimizer_settings)

    # ------------------------------------------------------------------------------- steps
    def train_step(self, batch: Mapping[str, torch.Tensor], *, lr: float, weight_decay: float,
                   progress: "StepProgress | None" = None, forward_step: Callable | None = None) -> float:
        """One optimizer step over the global ``batch`` at the current layout; the global mean loss
        (the same on every rank). ``progress``: how far it got (``megatron.step_progress``);
        ``forward_step``: this step's (``megatron.policy_loss.PolicyLoss``'s), default the model's."""
        from lightning_dynatrain.runtime.steps import train_step

        self._refuse_in_rollout("a training step")
        self._stepping = True
        try:
            return train_step(self.state, batch, self.recipe, lr=lr, weight_decay=weight_decay, progress=progress,
                              forward_step=forward_step)
        finally:
            self._stepping = False

    def eval_step(self, batch: Mapping[str, torch.Tensor]) -> float:
        """The global mean loss of the global ``batch`` at the current layout, forward only (the DDP
        model when the optimizer is built, else the bare shard: a ``validate`` run)."""
        from lightning_dynatrain.runtime.steps import eval_step

        if self._state is not None:
            return eval_step(self._state.chunks, self._state.groups, self._state.layout, batch, self.recipe)
        return eval_step(self.model_shard, self.groups, self.layout, batch, self.recipe)

    # ----------------------------------------------------------------------------- rollouts
    @property
    def in_rollout(self) -> bool:
        """Whether a rollout phase runs now."""
        return self._rollout is not None

    @contextmanager
    def rollout(self, layout: str | ParallelConfig, *, park: str = "in_place",
                keep_weights: bool = True) -> Iterator[RolloutPolicy]:
        """The training weights at ``layout`` for scoring and sampling (``runtime.rollout``), between two
        steps; on leaving, training's state at its layout as it was, bit for bit (checked with the
        switcher's ``verify``). Collective: every rank enters and leaves together.

        ``park``: ``"in_place"`` leaves the optimizer's state and gradient buffers where they are;
        ``"host"`` moves the optimizer's state to host memory and frees the gradient buffers (on CPU
        processes nothing moves: their memory is the host's). ``keep_weights=False`` frees the
        training shards of the weights meanwhile and refills them on leaving (a weights-only switch back);
        when that refill fails (a member died: it is a collective), its error is marked
        ``transition.errors.freed_state``: the state of this step is then whole only in an in-memory snapshot.

        A switch being built ahead (``prepare``) finishes its build first and stays built.

        Raises (before anything moved, every rank):
            RolloutError: inside a step, in a rollout already, or bad ``park``/``keep_weights``.
            LayoutError, WorldSizeError: ``layout`` does not fit the model or the world.
        """
        from lightning_dynatrain.megatron.execution import ExecutionOptions
        from lightning_dynatrain.megatron.rollout import PARKS, enter_rollout, leave_rollout
        from lightning_dynatrain.runtime.switcher import fingerprint, verify_unchanged

        try:
            if self._stepping:
                raise RolloutError("a rollout was asked for inside a training step",
                                   hint="enter it between two steps (before the step's train_step, or in a callback)")
            self._refuse_in_rollout("another rollout")
            if park not in PARKS or not isinstance(keep_weights, bool):
                raise RolloutError(f"park={park!r}, keep_weights={keep_weights!r}",
                                   hint=f"park is one of {', '.join(PARKS)}; keep_weights True or False")
            target = validate_target(layout, world_size=self.layout.world_size,
                                     current=self.layout, model=self.recipe.model, execution=ExecutionOptions())
        except DynaTrainError as err:
            raise mark_refused(err)
        switcher, state = self.switcher, self.state
        if not switcher.wait_for_build():  # a switch being built ahead finishes first (it stays built)
            raise mark_refused(RolloutError("a switch being built ahead did not finish within the training timeout",
                                            hint="see the build's warning on each rank; enter the rollout later"))
        setup = switcher.setup(self.recipe, self.optimizer_settings)
        before = fingerprint(state, setup) if switcher.verify else None
        phase = enter_rollout(state, target, setup, groups=switcher.groups, park=park, keep_weights=keep_weights,
                              subgroups=switcher.subgroups)
        policy = self._rollout = RolloutPolicy(phase, setup.spec)
        policy.figures = RolloutFigures(enter_seconds=phase.enter_seconds, enter_report=phase.enter_report,
                                        parked_bytes=phase.parked_bytes)
        try:
            yield policy
        finally:
            self._rollout = None
            start = time.perf_counter()
            try:
                report = leave_rollout(phase, setup, groups=switcher.groups, subgroups=switcher.subgroups)
            except BaseException as err:  # the weights' refill failed (a member died): they are gone here
                raise mark_freed(err) if not keep_weights else err
            policy.figures = dataclasses.replace(policy.figures, leave_report=report,
                                                 leave_seconds=time.perf_counter() - start)
        if before is not None:
            verify_unchanged(before, state, setup)

    def _refuse_in_rollout(self, what: str) -> None:
        if self._rollout is not None:
            raise mark_refused(RolloutError(f"{what} was asked for during a rollout phase (at {self._rollout.layout})",
                                            hint="leave the rollout (end its `with` block) first"))

    # ------------------------------------------------------------------------------ the end
    def close(self) -> None:
        """Megatron's groups and the switcher's go (while the world is up); the state and the groups
        are dropped (the model shard stays: the LightningModule holds it too)."""
        if self._switcher is not None and dist.is_available() and dist.is_initialized():
            from lightning_dynatrain.runtime.training_state import teardown_state

            teardown_state()
            self._switcher.close()
        self._state, self._groups = None, None


__all__ = ["TrainingRun"]
