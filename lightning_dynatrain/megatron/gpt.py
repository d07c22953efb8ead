"""A megatron-core ``GPTModel`` from a layout-free model shape and a parallel layout.

``GPTShape`` says what the model is (sizes, options); ``ParallelConfig`` says how it is split. The
same shape built at two layouts is the same logical model: ``build_gpt_model`` initialises every
weight from its layout-free name (see ``init.py``), so dp1-tp1-pp1 and dp1-tp2-pp2 start from
identical logical weights and give the same first loss.

Only megatron's *local* layer spec is used (``get_gpt_layer_local_spec``): Transformer Engine and
Apex are not required, and it runs on CPU through the host's megatron patches (``devices.host``).

Example::

    shape = GPTShape(hidden=64, layers=4, heads=4, query_groups=2, ffn_hidden=128,
                     vocab_size=120, seq_length=16)
    pgs = initialize_for_layout(layout, seed=0)
    model = build_gpt_model(shape, layout, seed=0)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.megatron.execution import ExecutionOptions, check_trainable
from lightning_dynatrain.megatron.init import init_layout_independent
from lightning_dynatrain.megatron.model_chunks import ChunkStage, build_chunks, pipeline_config_kwargs
from lightning_dynatrain.megatron.parallel_state_adapter import current_process_groups
from lightning_dynatrain.megatron.tp_attributes import tag_tensor_parallel_weights
from lightning_dynatrain.vps.errors import LayoutError, ModelSpecError
from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec
from lightning_dynatrain.vps.validate import validate_layout

if TYPE_CHECKING:
    from lightning_dynatrain.megatron.provider import ModelProvider


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTShape:
    """The layout-free description of a GPT model (what megatron needs beyond the layout)."""

    hidden: int
    """Model width (``hidden_size``)."""
    layers: int
    """Number of transformer layers; ``pp`` must divide it."""
    heads: int
    """Attention (query) heads; ``tp`` must divide it. ``hidden`` must be a multiple of it."""
    query_groups: int | None = None
    """Key/value heads for grouped-query attention; ``None`` means ``heads`` (plain MHA)."""
    ffn_hidden: int
    """Width of the dense MLP (of each half when ``gated_mlp``)."""
    vocab_size: int
    """Real vocabulary size; megatron pads it per TP size (``padded_vocab_size``)."""
    seq_length: int
    """Maximum sequence length (learned position embeddings have this many rows)."""
    gated_mlp: bool = False
    """SwiGLU MLP: ``linear_fc1`` holds gate and up projection ``[2*ffn, hidden]``, SiLU activation.
    Otherwise a GeLU MLP."""
    tied_embeddings: bool = True
    """Share the input embedding with the output layer (``share_embeddings_and_output_weights``)."""
    num_experts: int = 0
    """MoE experts per layer (every layer is MoE); 0 = dense MLP. ``ep`` must divide it."""
    moe_ffn_hidden: int | None = None
    """Width of each expert's MLP; ``None`` means ``ffn_hidden``."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_shared_expert_ffn_hidden: int = 0
    """Width of the shared expert MLP that every token passes through; 0 = none."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss weight; 0 disables the auxiliary loss."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head (``q_layernorm``/``k_layernorm`` of size head_dim)."""
    add_bias_linear: bool = True
    """Biases on the linear layers (qkv, proj, fc1, fc2)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Norm type of every layer norm (RMSNorm has no bias)."""
    position_embedding: Literal["rope", "learned_absolute"] = "rope"
    """Rotary (no parameter) or learned absolute position embeddings ``[seq_length, hidden]``."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times ``tp``."""
    init_method_std: float = 0.02
    """Std of the normal weight init; output projections use std / sqrt(2 * layers)."""

    def __post_init__(self) -> None:
        positive = ("hidden", "layers", "heads", "ffn_hidden", "vocab_size", "seq_length")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelSpecError(f"GPTShape.{name}={value!r} must be a positive integer")
        if self.hidden % self.heads:
            raise ModelSpecError(
                f"hidden={self.hidden} is not a multiple of heads={self.heads}",
                hint="pick hidden = heads * head_dim",
            )
        if self.heads % self.kv_heads:
            raise ModelSpecError(
                f"heads={self.heads} is not a multiple of query_groups={self.kv_heads}",
                hint="query_groups must divide heads",
            )
        if self.num_experts < 0 or (self.num_experts and self.moe_router_topk > self.num_experts):
            raise ModelSpecError(
                f"num_experts={self.num_experts}, moe_router_topk={self.moe_router_topk}",
                hint="use num_experts=0 for a dense model, else 1 <= moe_router_topk <= num_experts",
            )
        if self.moe_shared_expert_ffn_hidden and self.add_bias_linear:
            raise ModelSpecError(
                "megatron's shared experts have no biases",
                hint="set add_bias_linear=False or moe_shared_expert_ffn_hidden=0",
            )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ModelSpecError(f"normalization={self.normalization!r}", hint="use 'LayerNorm' or 'RMSNorm'")

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (query groups)."""
        return self.query_groups or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def expert_ffn_hidden(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # ------------------------------------------------- the model source protocol (model_source.py)
    @property
    def name(self) -> str:
        return "gpt"

    def spec(self) -> ModelSpec:
        """The hand-written description (``vps.gpt_spec``; equal to the one megatron's own
        description gives, ``tests/megatron/test_derived_spec.py``)."""
        return _spec_of(self)

    @property
    def builds_beside_training(self) -> bool:
        return True  # every module gets its groups from the pg_collection build_gpt_model passes

    def config_record(self) -> dict[str, str]:
        return {name: repr(getattr(self, name)) for name in self.__dataclass_fields__}

    def validate(self, layout: ParallelConfig, execution: ExecutionOptions) -> None:
        validate_layout_for_shape(self, layout, execution)

    def build(self, layout: ParallelConfig, *, seed: int, params_dtype: torch.dtype,
              pg_collection: ProcessGroupCollection, execution: ExecutionOptions, initialize: bool = True,
              device: torch.device | None = None, reseed: bool = True) -> GPTModel:
        return build_gpt_model(self, layout, seed=seed, params_dtype=params_dtype, pg_collection=pg_collection,
                               initialize=initialize, execution=execution, device=device, reseed=reseed)

    def forward_step(self, data_iterator: Iterator[Mapping[str, torch.Tensor]], model: torch.nn.Module):
        return gpt_forward_step(data_iterator, model)


@lru_cache(maxsize=16)
def _spec_of(shape: GPTShape) -> ModelSpec:
    return logical_spec(shape)


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's 3-tuple loss contract: (sum of token losses, token count, values to report)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss_sum, tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def gpt_forward_step(data_iterator: Iterator[Mapping[str, torch.Tensor]], model: torch.nn.Module):
    """Megatron's forward step for a GPT micro-batch (``tokens``, ``labels``, ``loss_mask``):
    positions 0..seq-1, the masked token losses summed, reported as ``lm loss`` ``[sum, tokens]``."""
    batch = next(data_iterator)
    tokens = batch["tokens"]
    positions = torch.arange(tokens.shape[1], dtype=torch.long).unsqueeze(0).expand_as(tokens)
    output = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=batch["labels"])
    mask = batch.get("loss_mask")
    if mask is None:
        mask = torch.ones_like(tokens, dtype=torch.float)
    return output, partial(_loss_func, mask)


def padded_vocab_size(shape: GPTShape, tp: int) -> int:
    """Megatron's vocabulary padding: round up to a multiple of ``make_vocab_size_divisible_by * tp``.

    The padded rows are real rows of the embedding and output layer: they get logits, take part in
    the softmax of the loss and are trained. Two layouts with different padded sizes therefore
    compute (slightly) different functions.

    >>> padded_vocab_size(GPTShape(hidden=8, layers=1, heads=1, ffn_hidden=8, vocab_size=100,
    ...                            seq_length=4, make_vocab_size_divisible_by=64), tp=2)
    128
    """
    multiple = shape.make_vocab_size_divisible_by * tp
    return int(math.ceil(shape.vocab_size / multiple) * multiple)


def logical_spec(shape: GPTShape, name: str = "gpt") -> ModelSpec:
    """The VPS description (logical tensors) of the model ``build_gpt_model`` builds for ``shape``."""
    dims = GPTDims(
        num_layers=shape.layers,
        hidden=shape.hidden,
        num_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        head_dim=shape.head_dim,
        ffn_hidden=shape.ffn_hidden,
        vocab_size=shape.vocab_size,
        seq_length=shape.seq_length,
        gated_mlp=shape.gated_mlp,
        normalization=shape.normalization,
        add_bias_linear=shape.add_bias_linear,
        qk_layernorm=shape.qk_layernorm,
        position_embedding=shape.position_embedding,
        tied_embeddings=shape.tied_embeddings,
        make_vocab_size_divisible_by=shape.make_vocab_size_divisible_by,
        num_experts=shape.num_experts,
        moe_ffn_hidden=shape.expert_ffn_hidden if shape.is_moe else 0,
        shared_expert_ffn=shape.moe_shared_expert_ffn_hidden if shape.is_moe else 0,
    )
    return build_gpt_spec(name, dims)


def validate_layout_for_shape(shape: GPTShape, layout: ParallelConfig,
                              execution: ExecutionOptions = ExecutionOptions()) -> None:
    """Check that ``layout`` splits ``shape`` (the VPS rules) and that megatron's local spec can run
    it with ``execution``'s options.

    Raises:
        LayoutError: a size does not divide, or the layout needs a feature the local spec lacks.
    """
    validate_layout(layout, logical_spec(shape))
    check_trainable(layout)
    if shape.is_moe and layout.etp > 1 and shape.add_bias_linear:
        raise LayoutError(f"layout {layout}: expert tensor parallelism (etp>1) needs add_bias_linear=False "
                          "in megatron 0.16", hint="set add_bias_linear=False or etp1")
    execution.check(str(layout), tp=layout.tp, seq_length=shape.seq_length, is_moe=shape.is_moe)


def transformer_config(
    shape: GPTShape,
    layout: ParallelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall",
    initialize: bool = True,
    execution: ExecutionOptions = ExecutionOptions(),
    on_device: bool = False,
) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for ``shape`` split by ``layout``.

    Fixed choices: CPU initialisation (every rank builds the full master weight and keeps its shard,
    needed on CPU and what makes shards layout-consistent) unless ``on_device`` (a model a switch
    fills, allocated on the current CUDA device with no init), no dropout, no fused kernels,
    ``SequentialMLP`` experts (no grouped GEMM without the ``grouped_gemm`` package). Sequence
    parallelism and activation recompute follow ``execution`` (sequence parallelism is always on
    when MoE runs with tp>1: megatron requires it there).
    """
    validate_layout_for_shape(shape, layout, execution)
    moe = {}
    if shape.is_moe:
        moe = dict(
            num_moe_experts=shape.num_experts,
            moe_ffn_hidden_size=shape.expert_ffn_hidden,
            moe_router_topk=shape.moe_router_topk,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type=moe_token_dispatcher,
            moe_router_load_balancing_type="aux_loss" if shape.moe_aux_loss_coeff else "none",
            moe_aux_loss_coeff=shape.moe_aux_loss_coeff,
            moe_shared_expert_intermediate_size=shape.moe_shared_expert_ffn_hidden or None,
        )
    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        ffn_hidden_size=shape.ffn_hidden,
        kv_channels=shape.head_dim,
        gated_linear_unit=shape.gated_mlp,
        activation_func=F.silu if shape.gated_mlp else F.gelu,
        add_bias_linear=shape.add_bias_linear,
        normalization=shape.normalization,
        qk_layernorm=shape.qk_layernorm,
        init_method_std=shape.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        num_layers_in_first_pipeline_stage=layout.first,
        num_layers_in_last_pipeline_stage=layout.last,
        **pipeline_config_kwargs(layout),
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        **execution.config_kwargs(layout.tp, is_moe=shape.is_moe),
        use_cpu_initialization=not on_device,
        perform_initialization=initialize,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        **moe,
    )


def layer_spec(shape: GPTShape):
    """Megatron's local (Transformer-Engine-free) layer spec for ``shape``."""
    return get_gpt_layer_local_spec(
        num_experts=shape.num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=shape.qk_layernorm,
        normalization=shape.normalization,
    )


def build_gpt_model(
    shape: GPTShape,
    layout: ParallelConfig,
    *,
    seed: int,
    params_dtype: torch.dtype = torch.float32,
    pg_collection: ProcessGroupCollection | None = None,
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall",
    initialize: bool = True,
    execution: ExecutionOptions = ExecutionOptions(),
    device: torch.device | None = None,
    reseed: bool = True,
) -> torch.nn.Module:
    """Build this rank's part of the GPT: its pipeline stage, its TP/EP shards: a ``GPTModel``, or with
    virtual stages its model chunks (``model_chunks.ModelChunks`` of ``GPTModel``, one per ``vp_stage``).

    Needs ``initialize_for_layout(layout, ...)`` first. Every weight is then re-initialised from a
    generator keyed by ``seed`` and the weight's layout-free name (``init.init_layout_independent``),
    so the logical model does not depend on the layout; biases and norms keep megatron's constant
    init. Collective over the embedding group when embeddings are tied and pp>1.

    Args:
        pg_collection: groups to build on; default: the current megatron groups.
        initialize: ``False`` allocates the parameters without initialising them (a hot switch fills
            them right after), skipping megatron's master-weight init and ``init_layout_independent``.
        execution: sequence parallelism and activation recompute (``ExecutionOptions``).
        device: where the model trains (default: the host). An initialised model is built on the host
            and moved there; the weights of one a switch fills (``initialize=False``) are allocated on
            a CUDA device directly, so no host copy of the shard is made and nothing uninitialised is
            copied (the few tensors megatron's torch-norm fallback makes on the host are moved).
        reseed: seed torch's global generator with ``seed`` first (an uninitialised model draws
            nothing: ``False`` leaves the generator alone, for a build off the training thread).
    """
    pgs = pg_collection if pg_collection is not None else current_process_groups()
    if pgs.tp.size() != layout.tp or pgs.pp.size() != layout.pp:
        raise LayoutError(
            f"process groups (tp={pgs.tp.size()}, pp={pgs.pp.size()}) do not match layout {layout}",
            hint="call initialize_for_layout(layout, seed=...) before build_gpt_model",
        )
    on_device = device is not None and device.type == "cuda" and not initialize
    config = transformer_config(shape, layout, params_dtype=params_dtype, moe_token_dispatcher=moe_token_dispatcher,
                                initialize=initialize, execution=execution, on_device=on_device)
    if reseed or initialize:
        torch.manual_seed(seed)

    def build_one(stage: ChunkStage) -> GPTModel:
        with device_kind(device if device is not None else "cpu").megatron_context():
            chunk = GPTModel(config=config, transformer_layer_spec=layer_spec(shape),
                             vocab_size=padded_vocab_size(shape, layout.tp), max_sequence_length=shape.seq_length,
                             pre_process=stage.pre_process, post_process=stage.post_process,
                             share_embeddings_and_output_weights=shape.tied_embeddings,
                             position_embedding_type=shape.position_embedding, parallel_output=True,
                             pg_collection=pgs, vp_stage=stage.vp_stage)
        if initialize:
            init_layout_independent(chunk, shape, layout, seed=seed, pg_collection=pgs)
        else:
            gated = shape.gated_mlp  # megatron's mlp.py cuts a gated linear_fc1 with stride 2
            tag_tensor_parallel_weights(chunk, lambda name: 2 if gated and name.endswith("linear_fc1") else 1)
        return chunk

    model = build_chunks(layout, pgs.pp.rank(), build_one)
    if device is not None and device.type != "cpu":  # what megatron keeps on the host (its torch norms)
        model = model.to(device)
    return model


def gpt_provider(shape: GPTShape) -> "ModelProvider":
    """The preset as a ``ModelProvider``: the same megatron ``GPTModel`` and forward step, its
    Virtual Parameter Space read from megatron's description instead of ``vps.gpt_spec`` (equal,
    ``tests/megatron/test_derived_spec.py``), its weights megatron's own initialisation at the
    layout the run starts at (``GPTShape`` draws them layout-independently)."""
    from lightning_dynatrain.megatron.provider import ModelProvider

    config = transformer_config(shape, ParallelConfig(), initialize=True)
    return ModelProvider(config=config, model_provider=partial(_gpt_module, shape), forward_step=gpt_forward_step,
                         vocab_size=shape.vocab_size, make_vocab_size_divisible_by=shape.make_vocab_size_divisible_by,
                         seq_length=shape.seq_length, name="gpt")


def _gpt_module(shape: GPTShape, config: TransformerConfig, pg_collection: ProcessGroupCollection, pre_process: bool,
                post_process: bool, vp_stage: int | None = None) -> GPTModel:
    return GPTModel(config=config, transformer_layer_spec=layer_spec(shape),
                    vocab_size=padded_vocab_size(shape, config.tensor_model_parallel_size),
                    max_sequence_length=shape.seq_length, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=shape.tied_embeddings,
                    position_embedding_type=shape.position_embedding, parallel_output=True,
                    pg_collection=pg_collection, vp_stage=vp_stage)


def release_rope_caches() -> None:
    """Empty megatron's rotary position-table caches, so that models let go can be freed.

    ``RotaryEmbedding.forward`` (and ``YarnRotaryEmbedding.forward``) carry a class-wide
    ``functools.lru_cache(maxsize=32)`` keyed by the module: every model built and run keeps its
    rotary module (with its old context-parallel group) and its table (``seq x dim`` floats, on the
    model's device) alive until 32 newer entries push it out. Call it when a model is dropped (a
    switch, teardown); a model still in use recomputes its table once, at its next forward.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    for cls in (RotaryEmbedding, YarnRotaryEmbedding):
        cache_clear = getattr(cls.forward, "cache_clear", None)
        if cache_clear is not None:  # megatron versions without the cache
            cache_clear()


__all__ = [
    "GPTShape",
    "build_gpt_model",
    "gpt_forward_step",
    "gpt_provider",
    "release_rope_caches",
    "layer_spec",
    "logical_spec",
    "padded_vocab_size",
    "transformer_config",
    "validate_layout_for_shape",
]
