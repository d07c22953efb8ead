"""Named model families at any size: a GPT-2-style dense model, a llama-style one and an MoE.

The demo and the tests pick a family and a size; the family fixes the architecture options:

- ``gpt``: LayerNorm, GeLU MLP, biases, tied embeddings, rotary positions;
- ``llama``: grouped-query attention (half as many key/value heads as query heads), SwiGLU MLP,
  RMSNorm, no biases, untied embeddings, rotary positions;
- ``moe``: the llama attention with a mixture of 4 SwiGLU experts per layer (top-2, dropless: no
  token is dropped, so losses agree across layouts), each half the dense MLP's width, plus a
  shared expert of that width; no biases (expert tensor parallelism needs none).

Example::

    shape = model_shape("llama", hidden=128, layers=4, heads=4, ffn_hidden=512, vocab_size=256,
                        seq_length=128)
"""

from __future__ import annotations

from lightning_dynatrain.megatron.gpt import GPTShape
from lightning_dynatrain.vps.errors import ModelSpecError

FAMILIES = ("gpt", "llama", "moe")


def model_shape(family: str, *, hidden: int, layers: int, heads: int, ffn_hidden: int, vocab_size: int,
                seq_length: int, make_vocab_size_divisible_by: int = 128) -> GPTShape:
    """The ``GPTShape`` of ``family`` (``FAMILIES``) at the given size.

    Raises:
        ModelSpecError: an unknown family, or sizes the family cannot take (e.g. an odd head
            count for llama's grouped-query attention).
    """
    size = dict(hidden=hidden, layers=layers, heads=heads, ffn_hidden=ffn_hidden, vocab_size=vocab_size,
                seq_length=seq_length, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    if family == "gpt":
        return GPTShape(**size)
    if family not in FAMILIES:
        raise ModelSpecError(f"unknown model family {family!r}", hint=f"choose one of {', '.join(FAMILIES)}")
    if heads % 2:
        raise ModelSpecError(f"{family}: heads={heads} cannot be shared by half as many key/value heads",
                             hint="use an even number of heads")
    llama = dict(query_groups=heads // 2, gated_mlp=True, normalization="RMSNorm", add_bias_linear=False,
                 tied_embeddings=False)
    if family == "llama":
        return GPTShape(**size, **llama)
    return GPTShape(**size, **llama, num_experts=4, moe_ffn_hidden=ffn_hidden // 2, moe_router_topk=2,
                    moe_shared_expert_ffn_hidden=ffn_hidden // 2)


__all__ = ["FAMILIES", "model_shape"]
