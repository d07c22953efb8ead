"""The Virtual Parameter Space read from megatron's own description (``vps.derive`` over
``megatron.probe``), against the hand-written GPT spec, and what it refuses.

One spawned process (gloo world 1, megatron's groups initialised) derives the specs of the GPT
presets through ``gpt_provider`` and of models with faults; the parent compares them and plans
switches with both specs (pure).
"""

from __future__ import annotations

import pytest

from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
from lightning_dynatrain.vps.description import canonical_tensors
from lightning_dynatrain.vps.errors import ModelSpecError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.planner import plan_rank
from lightning_dynatrain.vps.spec import Group, Precision
from lightning_dynatrain.vps.validate import layout_problems
from lightning_dynatrain.vps.zero_buffer import shard_buffer
from tests.dist import run_distributed

SMALL = dict(hidden=32, heads=4, ffn_hidden=64, vocab_size=120, seq_length=16, make_vocab_size_divisible_by=64)
#: the GPT presets' options: every family of megatron/shapes.py, and the options it does not set
PRESETS = {
    "gpt": GPTShape(layers=4, **SMALL),
    "llama": GPTShape(layers=4, **SMALL, query_groups=2, gated_mlp=True, normalization="RMSNorm",
                      add_bias_linear=False, tied_embeddings=False),
    "moe": GPTShape(layers=2, **SMALL, query_groups=2, gated_mlp=True, normalization="RMSNorm", add_bias_linear=False,
                    tied_embeddings=False, num_experts=4, moe_ffn_hidden=32, moe_shared_expert_ffn_hidden=32),
    "learned-qk-bias": GPTShape(layers=2, **SMALL, query_groups=2, gated_mlp=True, qk_layernorm=True,
                                position_embedding="learned_absolute"),
}
#: megatron 0.16 refuses expert tensor parallelism with biases: the probes then cut experts by ep beside tp
MOE_BIASES = GPTShape(layers=2, **SMALL, num_experts=2, moe_ffn_hidden=32)
#: switch pairs of 4 ranks (those of benchmarks/switch_vs_checkpoint.py, expert ones, uneven pipelines)
PAIRS = [("dp4-tp1-pp1", "dp2-tp2-pp1"), ("dp2-tp2-pp1", "dp1-tp2-pp2-zero1"), ("dp1-tp1-pp4", "dp4-tp1-pp1-zero1"),
         ("dp2-tp1-pp2-zero1", "dp1-tp4-pp1"), ("dp4-tp1-pp1-ep2", "dp2-tp2-pp1-ep2-zero1"),
         ("dp4-tp1-pp1-ep4-zero1", "dp2-tp1-pp2-ep2"), ("dp2-tp1-pp2-zero1-first1", "dp1-tp2-pp2-last1")]


def _faulty_providers() -> dict:
    """Providers a user might write wrongly, each with the fault the derivation must name."""
    from functools import partial

    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from lightning_dynatrain import ModelProvider
    from lightning_dynatrain.compat.megatron_versions import mlp_submodules
    from tests.strategy.own_models import gpt_forward_step, gpt_provider

    class GainedRowLinear(RowParallelLinear):
        """A row-parallel linear with a learned output gain its sharded_state_dict forgets."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.gain = torch.nn.Parameter(torch.ones(self.output_size))

        def forward(self, x):
            out, bias = super().forward(x)
            return out * self.gain, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            described = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            described.pop(f"{prefix}gain")
            return described

    spec = get_gpt_layer_local_spec()
    mlp_submodules(spec).linear_fc2 = GainedRowLinear
    dense = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, hidden_dropout=0.0,
                 attention_dropout=0.0)
    moe = dict(dense, normalization="RMSNorm", add_bias_linear=False, num_moe_experts=4, moe_ffn_hidden_size=32,
               moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
               moe_router_load_balancing_type="none", moe_grouped_gemm=False)
    moe_spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm")
    return {
        "undescribed": ModelProvider(config=TransformerConfig(**dense), forward_step=gpt_forward_step,
                                     model_provider=partial(gpt_provider, layer_spec=spec), vocab_size=256),
        "expert-bias": ModelProvider(config=TransformerConfig(**moe), forward_step=gpt_forward_step,
                                     model_provider=partial(gpt_provider, layer_spec=moe_spec), vocab_size=256),
        "no-vocabulary": ModelProvider(config=TransformerConfig(**dense), forward_step=gpt_forward_step,
                                       model_provider=partial(gpt_provider, layer_spec=get_gpt_layer_local_spec())),
    }


def _derive_job(rank: int, world_size: int) -> dict:
    """Every preset's derived spec, the own models' ``builds_beside_training``, each fault's error."""
    from lightning_dynatrain.megatron.gpt import gpt_provider
    from lightning_dynatrain.megatron.parallel_state_adapter import initialize_for_layout
    from tests.strategy import own_models

    initialize_for_layout(ParallelConfig(), seed=0)
    out: dict = {"derived": {name: gpt_provider(shape).spec() for name, shape in PRESETS.items()}, "errors": {}}
    out["moe-biases"] = gpt_provider(MOE_BIASES).spec()
    out["beside_training"] = {name: getattr(own_models, name)().builds_beside_training
                              for name in ("split_mlp_gpt", "bert", "sigmoid_moe")}
    for name, provider in _faulty_providers().items():
        try:
            provider.spec()
        except ModelSpecError as err:
            out["errors"][name] = str(err)
    return out


@pytest.fixture(scope="module")
def derived() -> dict:
    return run_distributed(_derive_job, 1, timeout_s=300)[0]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_megatrons_description_is_the_hand_written_gpt_spec(derived, name: str) -> None:
    """Tensor by tensor (matched by parameter name): the same elements cut the same way at every
    layout (axes in canonical form), place, buffer group, fp32-ness, registration order, vocabulary."""
    hand, read = logical_spec(PRESETS[name]), derived["derived"][name]
    assert canonical_tensors(read) == canonical_tensors(hand)
    assert [t.megatron_name for t in read.tensors] == [t.megatron_name for t in hand.tensors]
    assert (read.vocab_rows, read.num_layers, read.num_experts) == (hand.vocab_rows, hand.num_layers, hand.num_experts)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_switches_planned_with_either_spec_move_the_same_bytes(derived, name: str) -> None:
    hand, read = logical_spec(PRESETS[name]), derived["derived"][name]
    for src, dst in PAIRS:
        src, dst = ParallelConfig.parse(src), ParallelConfig.parse(dst)
        if (src.ep > 1 or dst.ep > 1) != PRESETS[name].is_moe or layout_problems(src, hand) or layout_problems(dst, hand):
            continue
        for precision in (Precision.FP32, Precision.BF16):
            for rank in range(4):
                a = plan_rank(hand, src, dst, rank, precision=precision)
                b = plan_rank(read, src, dst, rank, precision=precision)
                assert a.bytes(a.recvs, hand, precision) == b.bytes(b.recvs, read, precision), (src, dst, rank)
                assert a.bytes(a.retains, hand, precision) == b.bytes(b.retains, read, precision), (src, dst, rank)


def test_the_zero1_buffers_are_laid_out_alike(derived) -> None:
    """Megatron's distributed-optimizer buffer (order, padding, buckets) from either spec."""
    for name, shape in PRESETS.items():
        hand, read = logical_spec(shape), derived["derived"][name]
        names = {t.name: t.megatron_name for t in hand.tensors} | {t.name: t.megatron_name for t in read.tensors}
        for layout in ("dp2-tp1-pp2-zero1", "dp2-tp1-pp2-zero1-first1")[:1 + (shape.layers > 2)]:
            layout = ParallelConfig.parse(layout)
            for stage in (0, 1):
                a, b = (shard_buffer(s, layout, stage, Group.DENSE) for s in (hand, read))
                assert [(names[e.tensor], e.stack, e.start, e.stop) for e in a.entries] == \
                       [(names[e.tensor], e.stack, e.start, e.stop) for e in b.entries] and a.buckets == b.buckets


def test_an_moe_whose_experts_megatron_will_not_tp_split_switches_tp_beside_ep(derived) -> None:
    """Megatron 0.16 refuses etp > 1 with expert biases: the derived spec leaves experts uncut by tp
    (otherwise the hand-written one) and refuses etp > 1, while tp2 beside ep2 (etp1) fits."""
    read = derived["moe-biases"]
    assert canonical_tensors(read)["decoder.layers.{layer}.self_attention.linear_qkv.weight"][1] == ("layer", "tp")
    assert all("tp" not in t.axes for t in read.tensors if t.group is Group.EXPERT)
    assert layout_problems(ParallelConfig.parse("dp1-tp2-pp2-ep2-etp1"), read, 4) == []
    assert any("etp=2" in p for p in layout_problems(ParallelConfig.parse("dp2-tp2-pp1-ep2"), read, 4))


def test_a_parameter_no_description_covers_is_refused_by_name(derived) -> None:
    text = derived["errors"]["undescribed"]
    assert "decoder.layers.0.mlp.linear_fc2.gain" in text and "no sharded description" in text
    assert "sharded_state_dict()" in text


def test_state_outside_parameters_is_refused_by_name(derived) -> None:
    text = derived["errors"]["expert-bias"]
    assert "decoder.layers.mlp.router.expert_bias" in text and "moe_router_enable_expert_bias=False" in text


def test_a_vocabulary_axis_needs_its_padding_declared(derived) -> None:
    text = derived["errors"]["no-vocabulary"]
    assert "embedding.word_embeddings.weight" in text and "no vocabulary was declared" in text


def test_models_that_read_megatrons_globals_are_never_built_beside_training(derived) -> None:
    assert derived["beside_training"] == {"split_mlp_gpt": True, "bert": False, "sigmoid_moe": True}


def test_a_config_with_parallel_sizes_is_refused() -> None:
    from megatron.core.transformer import TransformerConfig

    from lightning_dynatrain import ModelProvider

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=2)
    with pytest.raises(ModelSpecError, match="sets tensor_model_parallel_size=2.*leave parallel sizes out"):
        ModelProvider(config=config, model_provider=lambda **kw: None, forward_step=lambda it, model: None)


def test_a_config_with_a_pipeline_split_is_refused() -> None:
    """The layout states how layers split over stages (``-firstN``/``-lastN``/``-vppN``); a config saying it too is
    refused at once, before any layout could disagree with it."""
    from megatron.core.transformer import TransformerConfig

    from lightning_dynatrain import ModelProvider

    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4,
                               account_for_embedding_in_pipeline_split=True)
    with pytest.raises(ModelSpecError, match="sets account_for_embedding_in_pipeline_split=True.*"
                                             "the layout states it.*'dp1-tp1-pp4-first1-last1'"):
        ModelProvider(config=config, model_provider=lambda **kw: None, forward_step=lambda it, model: None)
    # and the virtual stages (``-vppN``)
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                               virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ModelSpecError, match="sets virtual_pipeline_model_parallel_size=2.*'dp1-tp1-pp4-vpp2'"):
        ModelProvider(config=config, model_provider=lambda **kw: None, forward_step=lambda it, model: None)
