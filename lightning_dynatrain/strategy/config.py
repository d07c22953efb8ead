"""What the LightningModule tells the strategy: the model recipe and the optimizer settings.

Both are layout-free: the strategy builds megatron's modules, DDP and optimizer from them for the
current layout, and again for every layout it switches to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_dynatrain.megatron.execution import ExecutionOptions, Recompute

if TYPE_CHECKING:
    from lightning_dynatrain.megatron.gpt import GPTShape


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronRecipe:
    """How to build the model and cut the batch, at any layout."""

    shape: "GPTShape"
    """The layout-free model (``lightning_dynatrain.megatron.gpt.GPTShape``)."""
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


__all__ = ["AdamSettings", "MegatronRecipe"]
