"""Building a layout's training state: megatron's groups, the model shard, DDP and the optimizer.

A layout's whole megatron state is one object (``megatron.state.MegatronState``): the groups, the
``GPTModel`` shard, megatron's ``DistributedDataParallel`` and optimizer. Building it:

    groups  = init_groups(layout, seed=...)                    # megatron parallel_state (collective)
    model   = build_checked_model(recipe, layout, groups, rank=r)   # this rank's shard, its description checked
    state   = attach_optimizer(model, recipe, layout, optimizer, groups)   # DDP + optimizer

``build_training_state`` is those three in one call; front ends go through ``training_run.TrainingRun``,
which runs them in that order (the Lightning strategy across its hooks). A layout change turns the
state of layout A into the state of layout B in memory (``megatron.hot_switch``); the steps that
train it: ``steps.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection

from lightning_dynatrain.megatron.model_source import build_unfilled
from lightning_dynatrain.megatron.optimizer import build_ddp_chunks_and_optimizer
from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, destroy, initialize_for_layout
from lightning_dynatrain.megatron.state import MegatronState
from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe, optimizer_config
from lightning_dynatrain.runtime.layout_checks import validate_optimizer
from lightning_dynatrain.runtime.steps import microbatches
from lightning_dynatrain.vps.layout import ParallelConfig


def init_groups(layout: ParallelConfig, *, seed: int, groups: ProcessGroupCache | None = None) -> ProcessGroupCollection:
    """Megatron's groups for ``layout`` on the current WORLD (collective; replaces the previous ones)."""
    return initialize_for_layout(layout, seed=seed, groups=groups)


def build_model(recipe: MegatronRecipe, layout: ParallelConfig, groups: ProcessGroupCollection, *,
                device: torch.device | None = None, unfilled: bool = False) -> torch.nn.Module:
    """This rank's shard of the recipe's model at ``layout``, on ``layout``'s ``groups``; ``unfilled``:
    not initialised, for a switch to fill (``megatron.model_source.build_unfilled``)."""
    if unfilled:
        return build_unfilled(recipe.model, layout, seed=recipe.seed, params_dtype=recipe.params_dtype,
                              pg_collection=groups, execution=recipe.execution, device=device)
    return recipe.model.build(layout, seed=recipe.seed, params_dtype=recipe.params_dtype, pg_collection=groups,
                              execution=recipe.execution, device=device)


def check_model_description(recipe: MegatronRecipe, model: torch.nn.Module, layout: ParallelConfig, rank: int,
                            groups: ProcessGroupCollection, *, agree: bool = True) -> None:
    """Check that the module built for ``layout`` says it holds what the recipe's description places
    on ``rank`` (a ``ModelProvider``'s: read at probe layouts, here met on the live module). With
    ``agree``, collective over the world, so that every rank raises when one differs (without: a
    process joining a running fit, whose peers are not in this call, checks alone). Nothing for the
    GPT preset."""
    import torch.distributed as dist

    from lightning_dynatrain.megatron.describe import describe_module
    from lightning_dynatrain.vps.description import description_problems
    from lightning_dynatrain.vps.errors import ModelSpecError

    derived = getattr(recipe.model, "derived", None)
    if derived is None:
        return
    problems = description_problems(derived(), describe_module(model, layout=layout, rank=rank,
                                                               dp_cp_group=groups.dp_cp))
    failed = torch.tensor([1.0 if problems else 0.0], device=next(model.parameters()).device)
    if agree:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise ModelSpecError(
            f"the model built at {layout} does not hold what its description at the probe layouts says"
            + (f" (rank {rank}: {'; '.join(problems[:3])})" if problems else " (on another rank: see its error)"),
            hint="a module whose shards depend on megatron's parallel_state globals rather than the "
                 "pg_collection it is given cannot be described ahead; build it from pg_collection")


def build_checked_model(recipe: MegatronRecipe, layout: ParallelConfig, groups: ProcessGroupCollection, *, rank: int,
                        device: torch.device | None = None, unfilled: bool = False, agree: bool = True
                        ) -> torch.nn.Module:
    """Every front end's model: this rank's shard at ``layout`` (``build_model``), checked against the
    recipe's description (``check_model_description``: a ``ModelProvider``'s; with ``agree``,
    collective)."""
    model = build_model(recipe, layout, groups, device=device, unfilled=unfilled)
    check_model_description(recipe, model, layout, rank, groups, agree=agree)
    return model


def build_training_state(recipe: MegatronRecipe, layout: ParallelConfig, optimizer: "AdamSettings | OptimizerConfig",
                         *, seed: int, rank: int, groups: ProcessGroupCache | None = None,
                         device: torch.device | None = None) -> MegatronState:
    """A loop's whole set-up at ``layout``, in the order every front end runs it: the optimizer's
    settings checked against the layout, megatron's groups, the model shard (checked against its
    description), DDP and the optimizer. Collective over the world. (``DynaTrainStrategy`` runs
    the same steps across Lightning's hooks: groups in ``setup_environment``, the model in
    ``configure_model``, the optimizer in ``setup_optimizers``.)

    Raises:
        LayoutError: zero1 with an optimizer megatron's distributed optimizer does not take.
        ModelSpecError: the model built does not hold what its description says.
    """
    validate_optimizer(optimizer_config(optimizer), layout)
    pgs = init_groups(layout, seed=seed, groups=groups)
    model = build_checked_model(recipe, layout, pgs, rank=rank, device=device)
    return attach_optimizer(model, recipe, layout, optimizer, pgs)


def attach_optimizer(model: torch.nn.Module, recipe: MegatronRecipe, layout: ParallelConfig,
                     optimizer: "AdamSettings | OptimizerConfig", groups: ProcessGroupCollection) -> MegatronState:
    """Wrap ``model`` in megatron DDP and build its optimizer (``optimizer``'s settings), on ``groups``."""
    microbatches(recipe, layout)  # fail early
    chunks, built = build_ddp_chunks_and_optimizer(model, layout, config=optimizer_config(optimizer),
                                                   pg_collection=groups)
    return MegatronState(layout=layout, groups=groups, chunks=chunks, optimizer=built)


def teardown_state(groups: ProcessGroupCache | None = None) -> None:
    """Release megatron's groups, cached ones too (the modules must not communicate afterwards), and
    megatron's rotary-table cache (it would keep the run's last models alive)."""
    from lightning_dynatrain.megatron.gpt import release_rope_caches

    destroy()
    release_rope_caches()
    if groups is not None:
        groups.close()


__all__ = ["attach_optimizer", "build_checked_model", "build_model", "build_training_state", "check_model_description",
           "init_groups", "teardown_state"]
