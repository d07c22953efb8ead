"""The LightningModules ``DynaTrainStrategy`` trains: ``MegatronLightningModule`` and ``GPTLightningModule``.

Each says *what* to train; the strategy decides *how* (the layout): ``configure_model`` asks the
strategy to build this rank's shard, and ``training_step`` hands it the global batch, on which it
runs the whole megatron step (micro-batches, pipeline schedule, finalize grads, optimizer step).
Optimization is manual and each ``training_step`` is exactly one optimizer step, so
``trainer.global_step`` counts steps and a learning rate that is a function of it survives a layout
switch untouched.

- ``MegatronLightningModule``, for any megatron-core model: a layout-free model (a ``ModelProvider``:
  megatron's ``TransformerConfig``, ``model_provider`` and ``forward_step``), the batch sizes, and,
  from ``configure_optimizers``, megatron's ``OptimizerConfig`` behind a ``DynaTrainOptimizer`` with
  any learning-rate scheduler (a torch ``LRScheduler`` or megatron's ``OptimizerParamScheduler``).
  After each step the schedulers step once (``interval="step"``, Lightning's default for this
  module): their state is layout-free and checkpointed by Lightning, so the schedule survives
  switches, world changes and resumes exactly.
- ``GPTLightningModule``, the GPT preset: a ``GPTShape`` (the named families of ``megatron/shapes.py``
  included, ``model_shape("llama" | "moe", ...)``; an MoE model's expert layout switches like every
  other axis), Adam settings, batch sizes and a warmup-cosine schedule (``warmup_cosine_lr``). A batch
  may carry a ``loss_mask`` (megatron's ``GPTDataset`` gives one) and other per-row tensors
  (``"sample"``); the strategy slices them with the rows.

Examples::

    class MyModule(MegatronLightningModule):
        def configure_optimizers(self):
            optimizer = DynaTrainOptimizer(OptimizerConfig(optimizer="adam", lr=3e-4, min_lr=3e-5, weight_decay=0.1))
            schedule = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=100,
                                               lr_decay_steps=1000, lr_decay_style="cosine", start_wd=0.1,
                                               end_wd=0.1, wd_incr_steps=1000, wd_incr_style="constant")
            return {"optimizer": optimizer, "lr_scheduler": schedule}

    module = MyModule(provider, global_batch_size=16, micro_batch_size=2)

    shape = GPTShape(hidden=128, layers=4, heads=4, ffn_hidden=512, vocab_size=256, seq_length=128,
                     make_vocab_size_divisible_by=128)
    gpt = GPTLightningModule(shape, lr=3e-3, global_batch_size=16, micro_batch_size=2, warmup_steps=20, max_steps=300)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from lightning_dynatrain.megatron.execution import Recompute
from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe, warmup_cosine_lr
from lightning_dynatrain.strategy.optimizer_handle import DynaTrainOptimizer

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig

    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.megatron.model_source import ModelSource
    from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy


class MegatronLightningModule(pl.LightningModule):
    """A megatron-core model trained by ``DynaTrainStrategy`` (see the module docstring).

    Args:
        provider: the layout-free model (``ModelProvider``, or the preset's ``GPTShape``).
        global_batch_size: samples per optimizer step over all data-parallel ranks; the dataloader
            serves batches of exactly this many (``GlobalBatchSampler``); kept across switches.
        micro_batch_size: samples per micro-batch; ``global // (dp * micro)`` micro-batches per step.
        optimizer: megatron's ``OptimizerConfig`` for the default ``configure_optimizers`` (a
            constant rate); override ``configure_optimizers`` to add a scheduler.
        seed: seed of the weights' initialisation (megatron's own, at the layout the run starts at).
        params_dtype: ``None`` (default) follows ``Trainer(precision=...)``: ``"bf16-mixed"`` builds bf16
            params with fp32 main params; ``torch.bfloat16`` or ``torch.float32`` says it here instead.
        sequence_parallel, recompute: megatron's sequence parallelism wherever the layout has
            ``tp > 1``, and activation recompute (``MegatronRecipe``), at every layout.

    Logs ``train/loss`` (the global mean loss, the same float on every rank) and ``train/lr`` each
    step; ``validation_step`` logs ``val_loss``.
    """

    def __init__(self, provider: "ModelSource", *, global_batch_size: int, micro_batch_size: int,
                 optimizer: "OptimizerConfig | None" = None, seed: int = 1234, params_dtype: torch.dtype | None = None,
                 sequence_parallel: bool = False, recompute: Recompute = "none") -> None:
        super().__init__()
        self.provider = provider
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.optimizer_config = optimizer
        self.seed = seed
        self.params_dtype = params_dtype
        self.sequence_parallel = sequence_parallel
        self.recompute = recompute
        self.recipe  # noqa: B018 - a bad option fails here, not at the first step
        self.automatic_optimization = False
        self.model: torch.nn.Module | None = None
        #: (global_step, loss) of every step this process ran, for scripts and tests.
        self.losses: list[tuple[int, float]] = []

    @property
    def recipe(self) -> MegatronRecipe:
        return MegatronRecipe(model=self.provider, seed=self.seed, global_batch_size=self.global_batch_size,
                              micro_batch_size=self.micro_batch_size, params_dtype=self.params_dtype,
                              sequence_parallel=self.sequence_parallel, recompute=self.recompute)

    def _strategy(self) -> "DynaTrainStrategy":
        from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, DynaTrainStrategy):
            raise TypeError(f"{type(self).__name__} trains under DynaTrainStrategy, not {type(strategy).__name__}. "
                            "HINT: Trainer(strategy=DynaTrainStrategy(layout=...))")
        return strategy

    def configure_model(self) -> None:
        if self.model is None:  # configure_model runs on every fit/validate; build once
            self.model = self._strategy().build_model(self.recipe)

    def configure_optimizers(self) -> Any:
        if self.optimizer_config is None:
            raise NotImplementedError(
                f"{type(self).__name__} has no optimizer. HINT: pass optimizer=OptimizerConfig(...) or override "
                "configure_optimizers() to return DynaTrainOptimizer(OptimizerConfig(...)) (with a scheduler)")
        return DynaTrainOptimizer(self.optimizer_config)

    def scheduled_lr(self, step: int) -> float | None:
        """The learning rate of optimizer step ``step`` when the module sets it itself; ``None``
        (default): the optimizer's schedule group (its config's rate, or what a scheduler set)."""
        return None

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        strategy = self._strategy()
        step = self.trainer.global_step
        lr = self.scheduled_lr(step)
        if lr is None:
            lr = strategy.optimizer_handle.scheduled[0]
        loss = strategy.train_step(batch, lr=lr)
        self.losses.append((step + 1, loss))
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=self.global_batch_size)
        self.log("train/lr", lr, on_step=True, on_epoch=False, batch_size=self.global_batch_size)
        for config in self.trainer.lr_scheduler_configs:  # manual optimization: the module steps them
            self.lr_scheduler_step(config.scheduler, None)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """One optimizer step passed: megatron's ``OptimizerParamScheduler`` steps by one (it counts
        what the caller says), a torch scheduler as usual."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        if isinstance(scheduler, OptimizerParamScheduler):
            scheduler.step(increment=1)
        elif metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """The global batch's mean loss at the current layout, logged as ``val_loss`` (the same on
        every rank; ``sync_dist`` reduces it over the data-parallel ranks as any metric)."""
        loss = self._strategy().eval_step(batch)
        self.log("val_loss", loss, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=self.global_batch_size)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        assert self.model is not None, "configure_model() builds the model"
        return self.model(*args, **kwargs)


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


__all__ = ["GPTLightningModule", "MegatronLightningModule"]
