"""``GPTFamilyModule``: ``GPTLightningModule`` with its model named by family and size, for configs.

A config file should say ``family: llama`` and ``hidden: 256``, not spell out a ``GPTShape``'s
dozen architecture options; ``megatron.shapes.model_shape`` fixes those per family. Every argument
is a plain, typed value, so LightningCLI (jsonargparse) turns the signature into the ``model:``
section of the schema, with these docstrings as its help.

Example (``model:`` section of ``examples/configs/demo.yaml``)::

    model:
      family: llama
      hidden: 128
      layers: 4
      heads: 4
      ffn_hidden: 512
"""

from __future__ import annotations

from typing import Literal

from lightning_dynatrain.data.stdlib_text import VOCAB_SIZE
from lightning_dynatrain.megatron.execution import Recompute
from lightning_dynatrain.megatron.shapes import model_shape
from lightning_dynatrain.strategy.lightning_modules import GPTLightningModule
from lightning_dynatrain.runtime.layout_checks import vocab_divisor_for

Family = Literal["gpt", "llama", "moe"]
"""``megatron.shapes.FAMILIES``, spelled out for the schema (a test keeps the two equal)."""

#: without an explicit divisor, the vocabulary is padded alike at every one of these tp sizes
TP_SIZES_PADDED_ALIKE = (1, 2, 4, 8)


class GPTFamilyModule(GPTLightningModule):
    """A byte-level GPT of one family (``megatron.shapes``) trained by ``DynaTrainStrategy``.

    Args:
        family: ``gpt`` (LayerNorm, GeLU, biases, tied embeddings), ``llama`` (GQA, SwiGLU, RMSNorm,
            no biases) or ``moe`` (llama attention, 4 top-2 experts and a shared one per layer).
        hidden: model width.
        layers: transformer layers (a multiple of every pp the run uses).
        heads: attention heads (a multiple of every tp the run uses; even for llama and moe).
        ffn_hidden: MLP width (each expert's is half of it).
        seq_length: tokens per sample; the data module gets the same value.
        vocab_size: tokens of the vocabulary (256: bytes).
        make_vocab_size_divisible_by: megatron's vocabulary padding; ``None`` picks the one that pads
            alike at tp 1, 2, 4 and 8, so every layout of a schedule trains the same model.
        lr: peak learning rate (linear warmup, then cosine to a tenth of it at ``max_steps``).
        weight_decay: decoupled weight decay (not on biases and norms).
        global_batch_size: sequences per optimizer step over all data-parallel ranks; the data module
            gets the same value.
        micro_batch_size: sequences per micro-batch.
        warmup_steps: steps of linear warmup.
        max_steps: end of the cosine; ``None`` keeps the peak after warmup (the demo's command line
            sets it to the Trainer's ``max_steps``).
        seed: weight initialisation seed (the same logical model at every layout).
        sequence_parallel: megatron's sequence parallelism wherever the layout has ``tp > 1``.
        recompute: activation recompute: ``none``, ``selective`` (core attention) or ``full``.
    """

    def __init__(
        self,
        family: Family = "gpt",
        *,
        hidden: int = 128,
        layers: int = 4,
        heads: int = 4,
        ffn_hidden: int = 512,
        seq_length: int = 128,
        vocab_size: int = VOCAB_SIZE,
        make_vocab_size_divisible_by: int | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        global_batch_size: int = 16,
        micro_batch_size: int = 2,
        warmup_steps: int = 30,
        max_steps: int | None = None,
        seed: int = 1234,
        sequence_parallel: bool = False,
        recompute: Recompute = "none",
    ) -> None:
        divisor = make_vocab_size_divisible_by or vocab_divisor_for(vocab_size, list(TP_SIZES_PADDED_ALIKE))
        shape = model_shape(family, hidden=hidden, layers=layers, heads=heads, ffn_hidden=ffn_hidden,
                            vocab_size=vocab_size, seq_length=seq_length, make_vocab_size_divisible_by=divisor)
        super().__init__(shape, lr=lr, weight_decay=weight_decay, global_batch_size=global_batch_size,
                         micro_batch_size=micro_batch_size, warmup_steps=warmup_steps, max_steps=max_steps, seed=seed,
                         sequence_parallel=sequence_parallel, recompute=recompute)
        self.family = family


__all__ = ["Family", "GPTFamilyModule", "TP_SIZES_PADDED_ALIKE"]
