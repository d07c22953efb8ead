"""The steps that train a layout's state: one optimizer step, or a forward-only pass, over a GLOBAL batch.

``train_step`` cuts this rank's data-parallel share of the global batch by the state's layout, sets
the scheduled learning rate and weight decay the way megatron's scheduler does, and calls megatron's
pipeline schedule through ``megatron.train_step.run_train_step`` (forward/backward over the
micro-batches, finalize grads, optimizer step). ``eval_step`` runs the same forward passes only
(validation), on a model with or without its optimizer. Every front end trains through them
(``training_run.TrainingRun``), and a recovery replays lost steps through them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection

from lightning_dynatrain.data.sampler import dp_share_bounds
from lightning_dynatrain.megatron.state import MegatronState
from lightning_dynatrain.megatron.step_progress import StepProgress
from lightning_dynatrain.megatron.train_step import run_eval_step, run_train_step
from lightning_dynatrain.runtime.layout_checks import BatchSizeError, layout_microbatches
from lightning_dynatrain.runtime.recipe import MegatronRecipe
from lightning_dynatrain.vps.layout import ParallelConfig


def microbatches(recipe: MegatronRecipe, layout: ParallelConfig) -> int:
    """Micro-batches per optimizer step at ``layout``: global // (dp * micro) (``layout_microbatches``)."""
    return layout_microbatches(recipe.global_batch_size, recipe.micro_batch_size, layout)


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
               lr: float, weight_decay: float, progress: StepProgress | None = None,
               forward_step: Callable | None = None) -> float:
    """One optimizer step of the global ``batch`` at ``state``'s layout; the global mean loss (same on
    every rank). ``progress``: how far it got (``megatron.step_progress``); ``forward_step``: this
    step's (e.g. ``PolicyLoss(...).forward_step``), default the model's."""
    local = local_share(batch, dp_rank=state.dp_rank, dp_size=state.dp_size,
                        global_batch_size=recipe.global_batch_size)
    set_lr_and_wd(state.optimizer, lr=lr, weight_decay=weight_decay)
    return run_train_step(state.chunks, state.optimizer, local, state.layout, microbatches(recipe, state.layout),
                          forward_step=forward_step or recipe.model.forward_step, seq_length=recipe.model.seq_length,
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


__all__ = ["eval_step", "load_optimizer_state_dict", "local_share", "microbatches", "optimizer_state_dict",
           "set_lr_and_wd", "train_step"]
