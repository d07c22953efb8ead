"""Build the logical tensors of a Megatron-core ``GPTModel`` (local layer spec) from its dimensions.

The order of the tensors is Megatron's registration order, checked against a real ``GPTModel``
in ``tests/vps/test_gpt_spec_megatron.py``::

    embedding.word_embeddings.weight, [embedding.position_embeddings.weight]
    per layer: input_layernorm.{weight,bias}, self_attention.linear_proj.{weight,bias},
               self_attention.linear_qkv.{weight,bias}, self_attention.{q,k}_layernorm.{weight,bias},
               pre_mlp_layernorm.{weight,bias},
               dense: mlp.linear_fc1.{weight,bias}, mlp.linear_fc2.{weight,bias}
               MoE:   mlp.router.{weight,bias}, per local expert e:
                      mlp.experts.local_experts.{e}.linear_fc1.{weight,bias}, ...linear_fc2.{weight,bias},
                      mlp.shared_experts.linear_fc{1,2}.weight
    decoder.final_layernorm.{weight,bias}, output_layer.weight
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_dynatrain.vps.errors import ModelSpecError
from lightning_dynatrain.vps.spec import (
    EXPERT,
    LAYER,
    NONE,
    TP,
    VOCAB,
    Group,
    LogicalTensor,
    ModelSpec,
    Place,
)

_LAYERS = "decoder.layers.{layer}."


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTDims:
    """The dimensions that fix every parameter shape of a Megatron GPT.

    Attributes:
        num_layers: transformer layers.
        hidden: model width.
        num_heads: query heads.
        num_query_groups: key/value heads (GQA groups); equal to num_heads for plain attention.
        head_dim: per-head width (Megatron's ``kv_channels``); hidden / num_heads unless set.
        ffn_hidden: dense MLP width (per gate half for gated MLPs).
        vocab_size: true vocabulary size, before Megatron's padding.
        seq_length: needed only for learned absolute position embeddings.
        gated_mlp: SwiGLU-style fc1 with a gate and an up half.
        normalization: "LayerNorm" (weight and bias) or "RMSNorm" (weight only).
        add_bias_linear: biases on the linear layers.
        add_qkv_bias: bias on the QKV projection only (Qwen2 style).
        qk_layernorm: per-head norms on queries and keys.
        position_embedding: "rope" or "learned_absolute".
        tied_embeddings: output layer shares the word embedding.
        make_vocab_size_divisible_by: Megatron pads vocab to a multiple of this times tp.
        num_experts: 0 for a dense model; else every layer is MoE.
        moe_ffn_hidden: per-expert MLP width.
        shared_expert_ffn: width of the shared expert (0 = none).
        norms_fp32: norms stay fp32 under bf16 training (``LogicalTensor.always_fp32``): megatron's
            local layer spec builds them as plain torch norms, without a dtype. Transformer
            Engine's norms take the params dtype.
    """

    num_layers: int
    hidden: int
    num_heads: int
    num_query_groups: int | None = None
    head_dim: int | None = None
    ffn_hidden: int
    vocab_size: int
    seq_length: int = 2048
    gated_mlp: bool = True
    normalization: str = "RMSNorm"
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    position_embedding: str = "rope"
    tied_embeddings: bool = False
    make_vocab_size_divisible_by: int = 128
    num_experts: int = 0
    moe_ffn_hidden: int = 0
    shared_expert_ffn: int = 0
    norms_fp32: bool = True

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_heads

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden // self.num_heads


def build_gpt_spec(name: str, dims: GPTDims, *, published_parameters: int | None = None) -> ModelSpec:
    """The ``ModelSpec`` of a GPT with these dimensions."""
    _check(name, dims)
    L, h = dims.num_layers, dims.hidden
    g, hd = dims.groups, dims.kv_channels
    q_per_group = dims.num_heads // g
    norm_bias = dims.normalization == "LayerNorm"
    tensors: list[LogicalTensor] = []

    def add(local: str, shape: tuple[int, ...], axes: tuple[str, ...], *, group: Group = Group.DENSE,
            place: Place = Place.LAYERS, megatron: str | None = None, last: str | None = None,
            fp32: bool = False) -> None:
        if place is Place.LAYERS:
            full = "decoder.layers." + local
            megatron = megatron or _LAYERS + local
        else:
            full = local
            megatron = megatron or local
        tensors.append(LogicalTensor(full, shape, axes, group, place, megatron, last, always_fp32=fp32))

    def add_norm(prefix: str, width: int, *, place: Place = Place.LAYERS) -> None:
        lead, lead_axes = ((L,), (LAYER,)) if place is Place.LAYERS else ((), ())
        add(prefix + ".weight", lead + (width,), lead_axes + (NONE,), place=place, fp32=dims.norms_fp32)
        if norm_bias:
            add(prefix + ".bias", lead + (width,), lead_axes + (NONE,), place=place, fp32=dims.norms_fp32)

    # ---- pre-process (first stage); vocabulary rows: Megatron's padding at the largest valid tp
    multiple = dims.make_vocab_size_divisible_by * g
    vocab_rows = -(-dims.vocab_size // multiple) * multiple
    emb_place = Place.FIRST_AND_LAST if dims.tied_embeddings else Place.FIRST
    add("embedding.word_embeddings.weight", (vocab_rows, h), (VOCAB, NONE), place=emb_place,
        last="output_layer.weight" if dims.tied_embeddings else None)
    if dims.position_embedding == "learned_absolute":
        # a plain torch.nn.Embedding inside megatron's LanguageModelEmbedding: built without a dtype,
        # it stays fp32 under bf16 as the local spec's norms do
        add("embedding.position_embeddings.weight", (dims.seq_length, h), (NONE, NONE), place=Place.FIRST, fp32=True)

    # ---- one transformer layer, stacked over the layer axis
    add_norm("input_layernorm", h)
    add("self_attention.linear_proj.weight", (L, h, dims.num_heads * hd), (LAYER, NONE, TP))
    if dims.add_bias_linear:
        add("self_attention.linear_proj.bias", (L, h), (LAYER, NONE))
    # Megatron's fused QKV rows: per query group, q_per_group query heads then one key and one value head.
    add("self_attention.linear_qkv.weight", (L, g, q_per_group + 2, hd, h), (LAYER, TP, NONE, NONE, NONE))
    if dims.add_bias_linear or dims.add_qkv_bias:
        add("self_attention.linear_qkv.bias", (L, g, q_per_group + 2, hd), (LAYER, TP, NONE, NONE))
    if dims.qk_layernorm:
        add_norm("self_attention.q_layernorm", hd)
        add_norm("self_attention.k_layernorm", hd)
    add_norm("pre_mlp_layernorm", h)
    if dims.num_experts == 0:
        _add_mlp(add, "mlp", L, h, dims.ffn_hidden, dims.gated_mlp, dims.add_bias_linear)
    else:
        E, f = dims.num_experts, dims.moe_ffn_hidden
        add("mlp.router.weight", (L, E, h), (LAYER, NONE, NONE))
        if dims.add_bias_linear:
            add("mlp.router.bias", (L, E), (LAYER, NONE))
        expert_name = _LAYERS + "mlp.experts.local_experts.{expert}."
        if dims.gated_mlp:
            fc1, fc1_axes = ((L, E, 2, f, h), (LAYER, EXPERT, NONE, TP, NONE))
        else:
            fc1, fc1_axes = ((L, E, f, h), (LAYER, EXPERT, TP, NONE))
        expert_tensors = [("linear_fc1.weight", fc1, fc1_axes), ("linear_fc2.weight", (L, E, h, f), (LAYER, EXPERT, NONE, TP))]
        if dims.add_bias_linear:
            expert_tensors.insert(1, ("linear_fc1.bias", fc1[:-1], fc1_axes[:-1]))
            expert_tensors.append(("linear_fc2.bias", (L, E, h), (LAYER, EXPERT, NONE)))
        for local, shape, axes in expert_tensors:
            add("mlp.experts." + local, shape, axes, group=Group.EXPERT, megatron=expert_name + local)
        if dims.shared_expert_ffn:
            _add_mlp(add, "mlp.shared_experts", L, h, dims.shared_expert_ffn, dims.gated_mlp, False)

    # ---- post-process (last stage)
    add_norm("decoder.final_layernorm", h, place=Place.LAST)
    if not dims.tied_embeddings:
        add("output_layer.weight", (vocab_rows, h), (VOCAB, NONE), place=Place.LAST)

    return ModelSpec(
        name=name,
        num_layers=L,
        hidden=h,
        num_heads=dims.num_heads,
        num_query_groups=g,
        head_dim=hd,
        ffn_hidden=dims.ffn_hidden,
        vocab_size=dims.vocab_size,
        make_vocab_size_divisible_by=dims.make_vocab_size_divisible_by,
        num_experts=dims.num_experts,
        moe_ffn_hidden=dims.moe_ffn_hidden,
        tensors=tuple(tensors),
        published_parameters=published_parameters,
    )


def _add_mlp(add: Any, prefix: str, L: int, h: int, ffn: int, gated: bool, bias: bool) -> None:
    if gated:  # local fc1 rows are [gate slice; up slice]: logical [2, ffn, hidden] split on ffn
        add(f"{prefix}.linear_fc1.weight", (L, 2, ffn, h), (LAYER, NONE, TP, NONE))
        if bias:
            add(f"{prefix}.linear_fc1.bias", (L, 2, ffn), (LAYER, NONE, TP))
    else:
        add(f"{prefix}.linear_fc1.weight", (L, ffn, h), (LAYER, TP, NONE))
        if bias:
            add(f"{prefix}.linear_fc1.bias", (L, ffn), (LAYER, TP))
    add(f"{prefix}.linear_fc2.weight", (L, h, ffn), (LAYER, NONE, TP))
    if bias:
        add(f"{prefix}.linear_fc2.bias", (L, h), (LAYER, NONE))


def _check(name: str, dims: GPTDims) -> None:
    if dims.num_heads % dims.groups:
        raise ModelSpecError(f"{name}: {dims.num_heads} heads are not divisible into {dims.groups} query groups")
    if dims.normalization not in ("LayerNorm", "RMSNorm"):
        raise ModelSpecError(f"{name}: normalization {dims.normalization!r}", hint="use LayerNorm or RMSNorm")
    if dims.position_embedding not in ("rope", "learned_absolute", "none"):
        raise ModelSpecError(f"{name}: position embedding {dims.position_embedding!r}",
                             hint="use rope, learned_absolute or none")
    if dims.num_experts and (dims.moe_ffn_hidden <= 0):
        raise ModelSpecError(f"{name}: an MoE model needs moe_ffn_hidden > 0")
    if dims.shared_expert_ffn and dims.add_bias_linear:
        raise ModelSpecError(f"{name}: Megatron's shared experts have no biases",
                             hint="set add_bias_linear=False or shared_expert_ffn=0")


def dims_from_megatron(config: Any, *, vocab_size: int, seq_length: int = 2048, tied_embeddings: bool = False,
                       position_embedding: str = "rope", make_vocab_size_divisible_by: int = 128) -> GPTDims:
    """Read a Megatron ``TransformerConfig`` (duck-typed: no megatron import here)."""
    return GPTDims(
        num_layers=config.num_layers,
        hidden=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups or config.num_attention_heads,
        head_dim=config.kv_channels,
        ffn_hidden=config.ffn_hidden_size,
        vocab_size=vocab_size,
        seq_length=seq_length,
        gated_mlp=bool(config.gated_linear_unit),
        normalization=config.normalization,
        add_bias_linear=bool(config.add_bias_linear),
        add_qkv_bias=bool(getattr(config, "add_qkv_bias", False)),
        qk_layernorm=bool(config.qk_layernorm),
        position_embedding=position_embedding,
        tied_embeddings=tied_embeddings,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        num_experts=config.num_moe_experts or 0,
        moe_ffn_hidden=(config.moe_ffn_hidden_size or 0) if config.num_moe_experts else 0,
        shared_expert_ffn=(getattr(config, "moe_shared_expert_intermediate_size", None) or 0)
        if config.num_moe_experts else 0,
    )
