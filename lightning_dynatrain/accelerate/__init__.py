"""Accelerate: a plain PyTorch loop trains a megatron-core GPT under the project's layouts and switches
layout between steps, launched with ``accelerate launch``.

What a user writes (every rank runs it; ``accelerate launch --multi_gpu --num_processes 4 train.py``,
with ``Accelerator(cpu=True)`` on a machine without GPUs: 4 processes in Accelerate's MULTI_CPU mode,
gloo; on GPUs the same script runs on nccl)::

    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from lightning_dynatrain.accelerate import DynaTrainEngine, DynaTrainPlugin
    from lightning_dynatrain.data import StdlibBytes
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe, warmup_cosine_lr

    accelerator = Accelerator(cpu=True)
    set_seed(1234)
    plugin = DynaTrainPlugin(layout="dp2-tp2-pp1", schedule={100: "dp1-tp2-pp2"}, staging_budget="256MiB")
    shape = GPTShape(hidden=128, layers=4, heads=4, ffn_hidden=512, vocab_size=256, seq_length=128,
                     make_vocab_size_divisible_by=64)
    engine = DynaTrainEngine(accelerator, plugin,
                             recipe=MegatronRecipe(model=shape, seed=1234, global_batch_size=16, micro_batch_size=2),
                             adam=AdamSettings(lr=3e-3, weight_decay=0.01),
                             lr_at=lambda step: warmup_cosine_lr(step, peak=3e-3, warmup_steps=30, max_steps=300))
    loader = engine.dataloader(StdlibBytes(128), shuffle=True, seed=1234)
    model, optimizer, loader, scheduler = accelerator.prepare(engine.model, engine.optimizer, loader, engine.scheduler)

    for step, batch in zip(range(300), loader):
        loss = model(batch)          # the whole megatron step: pipeline schedule, grads, optimizer step
        accelerator.backward(loss)   # nothing left to do
        optimizer.step()             # the step boundary: step 100's switch to dp1-tp2-pp2 runs here
        scheduler.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step + 1} loss {loss.item():.4f} at {engine.layout}")
    accelerator.save_state("checkpoint")   # layout-free: load_state at any layout and number of processes
    engine.close()
    accelerator.end_training()

``loss = engine.train_step(batch)`` is the same step without the Accelerate objects (a float);
after ``model.eval()``, ``model(batch)`` is the forward-only loss of a global batch at the current
layout (``engine.eval_step``; validation batches from ``engine.eval_dataloader(dataset)``);
``engine.reconfigure("dp4-tp1-pp1")`` switches at once (every rank, between steps). Rank 0 prints
one line per switch.

How ``accelerator.prepare`` is kept from wrapping and sharding: Accelerate's ``prepare`` wraps a
trainable module in torch DDP over the whole world and shards a DataLoader by world size, both
wrong under tensor and pipeline parallelism. The model, optimizer and loader the engine hands out
carry ``_is_accelerate_prepared = True``, the mark Accelerate itself sets to avoid preparing an
object twice: ``prepare`` records them and returns them unchanged (no DDP, no device move, no
autocast, no sharding); the scheduler is no torch ``LRScheduler``, so ``prepare`` passes it through.
Megatron's own DDP (over the layout's data-parallel group) and the engine's slicing of the global
batch do the work instead. Passing them through ``prepare`` is optional: the loop works the same
without it. ``accelerator.save_state``/``load_state`` write and read the engine's layout-free
checkpoint through Accelerate's save/load pre-hooks (``checkpoint.py``), because Accelerate writes
rank 0's state dicts only; the run's progress joins them through ``register_for_checkpointing``.

The pieces, one per file: ``plugin`` (``DynaTrainPlugin``: the run's ``runtime.settings.DynaTrainSettings``
with ``DYNATRAIN_*`` environment variables and a ``dynatrain_config:`` YAML block), ``environment``
(what is taken from the Accelerator, and what is refused), ``library`` (the Accelerator as the
engine's ``LoopLibrary``), ``checkpoint`` (save/load hooks), ``engine`` (``DynaTrainEngine`` over an
Accelerator). The engine itself, the objects handed to ``prepare`` and the global-batch loader are
shared with the Fabric integration (``lightning_dynatrain.loop``).
"""

from lightning_dynatrain.accelerate.checkpoint import CheckpointError
from lightning_dynatrain.accelerate.engine import DynaTrainEngine
from lightning_dynatrain.accelerate.environment import AcceleratorSetupError
from lightning_dynatrain.accelerate.plugin import AccelerateConfigError, DynaTrainPlugin
from lightning_dynatrain.loop.data import global_batch_loader
from lightning_dynatrain.loop.engine import DataMismatchError
from lightning_dynatrain.loop.prepared import DynaTrainModel, DynaTrainScheduler, LoopOptimizer

__all__ = [
    "AccelerateConfigError",
    "AcceleratorSetupError",
    "CheckpointError",
    "DataMismatchError",
    "DynaTrainEngine",
    "DynaTrainModel",
    "DynaTrainPlugin",
    "DynaTrainScheduler",
    "LoopOptimizer",
    "global_batch_loader",
]
