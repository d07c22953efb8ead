"""In-process unit tests of the model description, the config mapping and the TP shard rule."""

from __future__ import annotations

import pytest
import torch

from lightning_dynatrain.megatron.gpt import (
    GPTShape,
    padded_vocab_size,
    transformer_config,
    validate_layout_for_shape,
)
from lightning_dynatrain.megatron.init import _shard
from lightning_dynatrain.vps.errors import LayoutError, ModelSpecError
from lightning_dynatrain.vps.layout import ParallelConfig

TINY = dict(hidden=32, layers=4, heads=4, query_groups=2, ffn_hidden=64, vocab_size=100, seq_length=16)


@pytest.mark.parametrize(
    "vocab,divisible,tp,padded",
    [(100, 128, 1, 128), (100, 64, 2, 128), (128, 64, 2, 128), (129, 64, 2, 256), (50257, 128, 8, 51200)],
)
def test_padded_vocab_size_follows_megatron(vocab, divisible, tp, padded):
    shape = GPTShape(**{**TINY, "vocab_size": vocab, "make_vocab_size_divisible_by": divisible})
    assert padded_vocab_size(shape, tp) == padded


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(hidden=30), "not a multiple of heads"),
        (dict(query_groups=3), "query_groups"),
        (dict(layers=0), "positive"),
        (dict(num_experts=2, moe_router_topk=3), "moe_router_topk"),
        (dict(normalization="BatchNorm"), "normalization"),
        (dict(num_experts=4, moe_shared_expert_ffn_hidden=16, add_bias_linear=True), "shared experts"),
    ],
)
def test_shape_errors_name_the_rule(change, words):
    with pytest.raises(ModelSpecError, match=words):
        GPTShape(**{**TINY, **change})


@pytest.mark.parametrize(
    "shape_change,layout,words",
    [
        ({}, "dp1-tp8-pp1", "tp=8 must divide the 4 attention heads"),
        ({}, "dp1-tp1-pp3", "pp=3 must divide the 4 layers"),
        ({}, "dp1-tp1-pp1-cp2", "context parallelism.*HINT: use cp1, e.g. dp2-tp1-pp1"),
        ({}, "dp1-tp1-pp2-vpp2", None),  # virtual stages train
        ({}, "dp1-tp1-pp2-first1", None),  # and so does an uneven pipeline
        ({}, "dp1-tp1-pp2-vpp3", "pp\\*vpp = 2\\*3 must divide the 4 layers"),
        ({}, "dp2-tp1-pp1-ep2", "needs experts"),
        (dict(num_experts=4, add_bias_linear=True), "dp1-tp2-pp1", "add_bias_linear=False"),
        (dict(num_experts=4, add_bias_linear=False), "dp4-tp1-pp1-ep4", None),
        (dict(num_experts=6, add_bias_linear=False), "dp4-tp1-pp1-ep4", "ep=4 must divide the 6 experts"),
    ],
)
def test_layout_validation(shape_change, layout, words):
    shape = GPTShape(**{**TINY, **shape_change})
    if words is None:
        validate_layout_for_shape(shape, ParallelConfig.parse(layout))
        return
    with pytest.raises(LayoutError, match=words) as err:
        validate_layout_for_shape(shape, ParallelConfig.parse(layout))
    assert "HINT" in str(err.value)


def test_transformer_config_choices():
    moe = GPTShape(**TINY, num_experts=4, add_bias_linear=False, gated_mlp=True, moe_shared_expert_ffn_hidden=16)
    config = transformer_config(moe, ParallelConfig.parse("dp1-tp2-pp1"))
    assert config.sequence_parallel and config.use_cpu_initialization and not config.moe_grouped_gemm
    assert config.hidden_dropout == config.attention_dropout == 0.0
    assert config.expert_tensor_parallel_size == 2 and config.moe_shared_expert_intermediate_size == 16
    assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
    dense = transformer_config(GPTShape(**TINY), ParallelConfig.parse("dp1-tp2-pp2"))
    assert not dense.sequence_parallel and dense.pipeline_dtype == torch.float32
    assert dense.num_query_groups == 2 and dense.kv_channels == 8


def test_stride_two_shard_is_gate_and_up_slices():
    """A gated fc1 [gate; up] at tp=2: rank r holds [gate_r; up_r], as megatron's CPU init cuts it."""
    gate, up = torch.arange(8.0), torch.arange(100.0, 108.0)
    master = torch.cat([gate, up]).unsqueeze(1)
    assert _shard(master, 0, 1, 2, stride=2).squeeze(1).tolist() == [4, 5, 6, 7, 104, 105, 106, 107]
    assert _shard(master, 0, 1, 2, stride=1).squeeze(1).tolist() == list(range(100, 108))
