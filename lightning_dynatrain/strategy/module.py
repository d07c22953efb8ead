"""``GPTLightningModule``: a ready LightningModule for a megatron-core GPT under ``DynaTrainStrategy``.

It says *what* to train (a ``GPTShape``, Adam settings, batch sizes, an LR schedule); the strategy
decides *how* (the layout): ``configure_model`` asks the strategy to build this rank's shard, and
``training_step`` hands the global batch to the strategy, which runs the whole megatron step
(micro-batches, pipeline schedule, finalize grads, optimizer step). Optimization is manual, and each
``training_step`` is exactly one optimizer step, so ``trainer.global_step`` counts steps and the
learning rate is a plain function of it: it survives a layout switch untouched.

Any ``GPTShape`` trains, the named families of ``megatron/shapes.py`` included
(``model_shape("llama" | "moe", ...)``); an MoE model's expert layout (``ep``, ``etp``) switches like
every other axis. A batch may carry a ``loss_mask`` (megatron's ``GPTDataset`` gives one) and other
per-row tensors (``"sample"``); the strategy slices them with the rows.

Example::

    shape = GPTShape(hidden=128, layers=4, heads=4, ffn_hidden=512, vocab_size=256, seq_length=128,
                     make_vocab_size_divisible_by=128)
    module = GPTLightningModule(shape, lr=3e-3, global_batch_size=16, micro_batch_size=2, warmup_steps=20,
                                max_steps=300)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from lightning_dynatrain.megatron.execution import Recompute
from lightning_dynatrain.strategy.config import AdamSettings
from lightning_dynatrain.strategy.lightning_module import MegatronLightningModule

if TYPE_CHECKING:
    from lightning_dynatrain.megatron.gpt import GPTShape


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


class GPTLightningModule(MegatronLightningModule):
    """A megatron-core GPT trained by ``DynaTrainStrategy`` (see module docstring): the preset's
    ``MegatronLightningModule``, with Adam and a warmup + cosine schedule of its own.

    Args:
        shape: the layout-free model.
        lr: peak learning rate.
        weight_decay: decoupled weight decay (not on biases and 1-D params).
        global_batch_size: sequences per optimizer step over all data-parallel ranks; the dataloader
            must serve batches of exactly this many (``GlobalBatchSampler``).
        micro_batch_size: sequences per micro-batch; ``global // (dp * micro)`` micro-batches per step.
        warmup_steps, max_steps, min_lr_ratio: the warmup + cosine schedule (``warmup_cosine_lr``);
            ``max_steps=None`` keeps the peak after warmup.
        betas, eps, clip_grad: Adam and gradient clipping.
        seed: weight initialisation seed (the same logical model at every layout).
        params_dtype: ``None`` (default) follows ``Trainer(precision=...)``: ``"bf16-mixed"`` builds bf16
            params with fp32 main params; ``torch.bfloat16`` or ``torch.float32`` says it here instead.
        sequence_parallel: megatron's sequence parallelism wherever the layout has ``tp > 1``.
        recompute: activation recompute, ``"none"``, ``"selective"`` (core attention) or ``"full"``.
            Both hold at every layout the run switches to (``MegatronRecipe``).

    Logs ``train/loss`` (the global mean loss, the same float on every rank) and ``train/lr`` each step.
    """

    def __init__(
        self,
        shape: "GPTShape",
        *,
        lr: float,
        weight_decay: float = 0.0,
        global_batch_size: int,
        micro_batch_size: int,
        warmup_steps: int = 0,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        clip_grad: float = 1.0,
        seed: int = 1234,
        params_dtype: torch.dtype | None = None,
        sequence_parallel: bool = False,
        recompute: Recompute = "none",
    ) -> None:
        super().__init__(shape, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, seed=seed,
                         params_dtype=params_dtype, sequence_parallel=sequence_parallel, recompute=recompute)
        self.shape = shape
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.min_lr_ratio = min_lr_ratio
        self.betas = betas
        self.eps = eps
        self.clip_grad = clip_grad

    def lr_at(self, step: int) -> float:
        return warmup_cosine_lr(step, peak=self.lr, warmup_steps=self.warmup_steps, max_steps=self.max_steps,
                                min_ratio=self.min_lr_ratio)

    def scheduled_lr(self, step: int) -> float:
        return self.lr_at(step)

    def configure_optimizers(self) -> AdamSettings:
        return AdamSettings(lr=self.lr, weight_decay=self.weight_decay, betas=self.betas, eps=self.eps,
                            clip_grad=self.clip_grad)


__all__ = ["GPTLightningModule", "warmup_cosine_lr"]
