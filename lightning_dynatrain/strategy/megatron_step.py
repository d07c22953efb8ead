"""The megatron side of ``DynaTrainStrategy``, as plain functions over one ``MegatronState``.

A layout's whole megatron state is one object (``megatron.state.MegatronState``): the groups, the
``GPTModel`` shard, megatron's ``DistributedDataParallel`` and optimizer. Building it:

    groups  = init_groups(layout, seed=...)                    # megatron parallel_state (collective)
    model   = build_checked_model(recipe, layout, groups, rank=r)   # this rank's shard, its description checked
    state   = attach_optimizer(model, recipe, layout, optimizer, groups)   # DDP + optimizer

``build_training_state`` is those three in one call (the loop engine's set-up); the Lightning
strategy runs them across its hooks.

A layout change turns the state of layout A into the state of layout B in memory
(``megatron.hot_switch``).

``train_step`` runs one optimizer step over the GLOBAL batch: it cuts this rank's data-parallel
share by the state's layout, sets the scheduled learning rate, and calls megatron's pipeline
schedule through ``run_train_step`` (forward/backward over micro-batches, finalize grads, step).
``eval_step`` runs the same forward passes only (validation), on a model with or without its
optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection

from lightning_dynatrain.data.sampler import dp_share_bounds
from lightning_dynatrain.megatron.model_source import build_unfilled
from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer
from lightning_dynatrain.megatron.train_step import run_eval_step, run_train_step
from lightning_dynatrain.megatron.parallel_state_adapter import ProcessGroupCache, destroy, initialize_for_layout
from lightning_dynatrain.megatron.state import MegatronState
from lightning_dynatrain.megatron.step_progress import StepProgress
from lightning_dynatrain.strategy.config import AdamSettings, MegatronRecipe, optimizer_config
from lightning_dynatrain.strategy.validation import BatchSizeError, num_microbatches, validate_optimizer
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


def microbatches(recipe: MegatronRecipe, layout: ParallelConfig) -> int:
    """Micro-batches per optimizer step at ``layout``: global // (dp * micro)."""
    return num_microbatches(recipe.global_batch_size, layout.dp * layout.cp, recipe.micro_batch_size)


def attach_optimizer(model: torch.nn.Module, recipe: MegatronRecipe, layout: ParallelConfig,
                     optimizer: "AdamSettings | OptimizerConfig", groups: ProcessGroupCollection) -> MegatronState:
    """Wrap ``model`` in megatron DDP and build its optimizer (``optimizer``'s settings), on ``groups``."""
    microbatches(recipe, layout)  # fail early
    ddp, built = build_ddp_and_optimizer(model, layout, config=optimizer_config(optimizer), pg_collection=groups)
    return MegatronState(layout=layout, groups=groups, ddp=ddp, optimizer=built)


def teardown_state(groups: ProcessGroupCache | None = None) -> None:
    """Release megatron's groups, cached ones too (the modules must not communicate afterwards), and
    megatron's rotary-table cache (it would keep the run's last models alive)."""
    from lightning_dynatrain.megatron.gpt import release_rope_caches

    destroy()
    release_rope_caches()
    if groups is not None:
        groups.close()


def set_lr_and_wd(optimizer: MegatronOptimizer, *, lr: float, weight_decay: float) -> None:
    """Apply a scheduled learning rate and weight decay the way megatron's ``OptimizerParamScheduler``
    does: times each group's ``lr_mult`` / ``wd_mult`` (``wd_mult`` is 0 for biases and 1-D params)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


def local_share(batch: Mapping[str, torch.Tensor], *, dp_rank: int, dp_size: int,
                global_batch_size: int) -> dict[str, torch.Tensor]:
    """This data-parallel rank's rows of a global batch (contiguous, by the current layout).

    Raises:
        BatchSizeError: the batch is not a global batch of ``global_batch_size`` rows.
    """
    rows = next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0), 0)
    if rows != global_batch_size:
        raise BatchSizeError(
            f"the dataloader gave a batch of {rows} sequences, expected the global batch of {global_batch_size}",
            hint="serve GLOBAL batches on every rank (lightning_dynatrain.data.GlobalBatchSampler); the strategy "
            "slices the data-parallel share itself",
        )
    start, end = dp_share_bounds(global_batch_size, dp_rank, dp_size)
    return {k: v[start:end] for k, v in batch.items() if isinstance(v, torch.Tensor)}


def train_step(state: MegatronState, batch: Mapping[str, torch.Tensor], recipe: MegatronRecipe, *,
               lr: float, weight_decay: float, progress: StepProgress | None = None) -> float:
    """One optimizer step of the global ``batch`` at ``state``'s layout; the global mean loss (same on
    every rank). ``progress``: how far it got (``megatron.step_progress``)."""
    local = local_share(batch, dp_rank=state.dp_rank, dp_size=state.dp_size,
                        global_batch_size=recipe.global_batch_size)
    set_lr_and_wd(state.optimizer, lr=lr, weight_decay=weight_decay)
    return run_train_step(state.ddp, state.optimizer, local, state.layout, microbatches(recipe, state.layout),
                          forward_step=recipe.model.forward_step, seq_length=recipe.model.seq_length,
                          pg_collection=state.groups, progress=progress)


def eval_step(model: torch.nn.Module, groups: ProcessGroupCollection, layout: ParallelConfig,
              batch: Mapping[str, torch.Tensor], recipe: MegatronRecipe) -> float:
    """The global mean loss of the global ``batch`` at ``layout``, forward only (same on every rank).

    ``model`` is megatron's DDP when an optimizer is built (fitting), else the bare model shard
    (``trainer.validate``).
    """
    dp = groups.dp
    local = local_share(batch, dp_rank=dp.rank(), dp_size=dp.size(), global_batch_size=recipe.global_batch_size)
    return run_eval_step(model, local, layout, microbatches(recipe, layout), forward_step=recipe.model.forward_step,
                         seq_length=recipe.model.seq_length, pg_collection=groups)


def optimizer_state_dict(state: MegatronState) -> dict:
    """This rank's optimizer state: the inner torch optimizers' state dicts (same-layout resume only)."""
    return {"layout": str(state.layout), "inner": [None if o is None else o.state_dict() for o in _inner(state)]}


def load_optimizer_state_dict(state: MegatronState, saved: Mapping) -> None:
    """Load what ``optimizer_state_dict`` saved, into an optimizer built for the same layout."""
    inner = _inner(state)
    if saved.get("layout") != str(state.layout) or len(saved["inner"]) != len(inner):
        raise ValueError(f"optimizer state of layout {saved.get('layout')} cannot load at {state.layout}")
    for opt, sd in zip(inner, saved["inner"]):
        if opt is not None and sd is not None:
            opt.load_state_dict(sd)


def _inner(state: MegatronState) -> list[torch.optim.Optimizer | None]:
    subs = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
    return [getattr(sub, "optimizer", None) for sub in subs]


__all__ = [
    "attach_optimizer",
    "build_model",
    "build_checked_model",
    "build_training_state",
    "check_model_description",
    "eval_step",
    "init_groups",
    "load_optimizer_state_dict",
    "local_share",
    "microbatches",
    "optimizer_state_dict",
    "set_lr_and_wd",
    "teardown_state",
    "train_step",
]
