"""The named model families (``megatron/shapes.py``) have the architecture their names promise."""

from __future__ import annotations

import pytest

from lightning_dynatrain.megatron.shapes import model_shape
from lightning_dynatrain.vps.errors import ModelSpecError

SIZE = dict(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32)


def test_llama_is_gqa_swiglu_rope_rmsnorm_untied_without_biases() -> None:
    shape = model_shape("llama", **SIZE)
    attention = (shape.kv_heads, shape.gated_mlp, shape.normalization, shape.position_embedding)
    assert attention == (2, True, "RMSNorm", "rope")
    assert not shape.tied_embeddings and not shape.add_bias_linear and not shape.is_moe


def test_moe_is_llama_attention_with_four_top2_experts_and_a_shared_one() -> None:
    shape = model_shape("moe", **SIZE)
    experts = (shape.num_experts, shape.moe_router_topk, shape.expert_ffn_hidden, shape.moe_shared_expert_ffn_hidden)
    assert experts == (4, 2, 32, 32)
    assert shape.moe_aux_loss_coeff == 0.0 and not shape.add_bias_linear  # no load-balancing loss; etp > 1 allowed
    assert (shape.kv_heads, shape.gated_mlp, shape.normalization) == (2, True, "RMSNorm")


@pytest.mark.parametrize("family, heads, words", [("mixtral", 4, "unknown model family"), ("llama", 3, "heads=3")])
def test_a_family_or_size_it_cannot_take_is_refused(family: str, heads: int, words: str) -> None:
    with pytest.raises(ModelSpecError, match=f"{words}.*HINT"):
        model_shape(family, **dict(SIZE, heads=heads, hidden=heads * 8))
