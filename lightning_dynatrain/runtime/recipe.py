"""What the LightningModule tells the strategy: the model recipe and the optimizer settings.

Both are layout-free: the strategy builds megatron's modules, DDP and optimizer from them for the
current layout, and again for every layout it switches to. The model is a ``ModelProvider`` (a
megatron-core model of the user's) or a ``GPTShape`` (the preset); the optimizer is megatron's
``OptimizerConfig`` (``AdamSettings`` is the preset's shorthand for one). ``warmup_cosine_lr`` is the
GPT preset's learning-rate schedule, a function of the step (every front end's loop can use it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_dynatrain.megatron.execution import ExecutionOptions, Recompute

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig

    from lightning_dynatrain.megatron.model_source import ModelSource


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronRecipe:
    """How to build the model and cut the batch, at any layout."""

    model: "ModelSource"
    """The layout-free model: a ``ModelProvider`` (``megatron.provider``) or a ``GPTShape``."""
    seed: int
    """Initialisation seed; the same seed gives the same logical weights at every layout."""
    global_batch_size: int
    """Samples per optimizer step over all data-parallel ranks; kept across switches."""
    micro_batch_size: int
    """Samples per micro-batch; micro-batches per step = global // (dp * micro)."""
    params_dtype: torch.dtype | None = None
    """Parameter dtype (bf16 gets fp32 main params in the optimizer); ``None`` follows
    ``Trainer(precision=...)`` (``strategy.precision``)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism wherever the layout has ``tp > 1`` (kept across switches)."""
    recompute: Recompute = "none"
    """Activation recompute: ``"none"``, ``"selective"`` (core attention) or ``"full"`` (every layer)."""

    def __post_init__(self) -> None:
        self.execution  # noqa: B018 - a bad recompute value fails here, where the recipe is written

    @property
    def execution(self) -> ExecutionOptions:
        """How megatron runs the model at every layout (``ExecutionOptions``)."""
        return ExecutionOptions(sequence_parallel=self.sequence_parallel, recompute=self.recompute)


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamSettings:
    """Megatron Adam (decoupled weight decay); returned by ``configure_optimizers`` under this strategy.

    The learning rate here is the peak; the module passes the scheduled value at each step.
    """

    lr: float
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay; megatron's groups skip biases and 1-D params (``wd_mult=0``)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's (beta1, beta2)."""
    eps: float = 1e-8
    """Adam's epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping (0 disables it)."""

    def optimizer_config(self) -> "OptimizerConfig":
        """The same settings as megatron's ``OptimizerConfig`` (Adam; ``min_lr`` the peak: the module
        sets each step's rate)."""
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=self.lr, min_lr=self.lr, weight_decay=self.weight_decay,
                               adam_beta1=self.betas[0], adam_beta2=self.betas[1], adam_eps=self.eps,
                               clip_grad=self.clip_grad)


def optimizer_config(settings: "AdamSettings | OptimizerConfig") -> "OptimizerConfig":
    """Megatron's ``OptimizerConfig`` for what ``configure_optimizers`` gave."""
    return settings.optimizer_config() if isinstance(settings, AdamSettings) else settings


def warmup_cosine_lr(step: int, *, peak: float, warmup_steps: int, max_steps: int | None, min_ratio: float = 0.1) -> float:
    """Learning rate at optimizer step ``step``: linear warmup to ``peak``, then cosine down to ``min_ratio * peak``
    at ``max_steps`` (constant after it; no decay when ``max_steps`` is ``None``).

    >>> warmup_cosine_lr(0, peak=1.0, warmup_steps=10, max_steps=100)
    0.1
    >>> warmup_cosine_lr(100, peak=1.0, warmup_steps=10, max_steps=100)
    0.1
    """
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if max_steps is None or max_steps <= warmup_steps:
        return peak
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


__all__ = ["AdamSettings", "MegatronRecipe", "optimizer_config", "warmup_cosine_lr"]
