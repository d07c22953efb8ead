"""Models nobody in this project hand-described, written as a user writes them: a megatron
``TransformerConfig``, a ``model_provider`` and a ``forward_step`` each, given to ``ModelProvider``.

- ``split_mlp_gpt``: a GPT whose layer spec swaps megatron's fused SwiGLU ``linear_fc1`` for a
  module of the user's (``GateUpLinear``: separate gate and up ``ColumnParallelLinear``s, with its
  own ``sharded_state_dict``), built in bf16 by the test.
- ``bert``: megatron's BERT with its local layer spec (masked-LM and sentence-order heads, token-type
  embeddings, a pooler, a tied and padded vocabulary). Multi-latent attention is not among these:
  megatron-core 0.16's ``MLASelfAttention`` hands ``k_channels`` to its core attention, which only
  Transformer Engine's takes (``DotProductAttention.__init__() got an unexpected keyword argument
  'k_channels'`` with the local spec).
- ``sigmoid_moe``: an MoE whose router is not the preset's: sigmoid scores, group-limited top-k
  (DeepSeek-V3 style), a top-k scaling factor, and shared experts.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

VOCAB, SEQ = 256, 32
GLOBAL_BATCH, MICRO_BATCH = 8, 1
MASK_TOKEN = 255  # BERT's [MASK]: a byte the stdlib's sources do not use


# --------------------------------------------------------------------------- a GPT of the user's
def _gate_up_linear():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    class GateUpLinear(MegatronModule):
        """SwiGLU's input projection as two tensor-parallel linears (gate, up) instead of one fused
        ``[2 * ffn, hidden]`` weight; megatron's MLP splits its output in halves as for the fused one."""

        def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                     is_expert, tp_comm_buffer_name=None, tp_group=None, stride=1, name=None):
            super().__init__(config=config)
            self.tp_group = tp_group
            half = dict(config=config, init_method=init_method, gather_output=gather_output, bias=bias,
                        skip_bias_add=True, is_expert=is_expert, tp_group=tp_group)
            self.gate = ColumnParallelLinear(input_size, output_size // 2, **half)
            self.up = ColumnParallelLinear(input_size, output_size // 2, **half)

        def forward(self, x):
            gate, _ = self.gate(x)
            up, _ = self.up(x)
            return torch.cat([gate, up], dim=-1), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            state = self.state_dict(prefix="", keep_vars=True)
            return make_sharded_tensors_for_checkpoint(state, prefix, {"gate.weight": 0, "up.weight": 0},
                                                       sharded_offsets, tp_group=self.tp_group,
                                                       dp_cp_group=metadata["dp_cp_group"])

    return GateUpLinear


def split_mlp_layer_spec():
    """Megatron's local GPT layer spec with the user's ``GateUpLinear`` as the MLP's ``linear_fc1``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from lightning_dynatrain.compat.megatron_versions import mlp_submodules

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mlp_submodules(spec).linear_fc1 = _gate_up_linear()
    return spec


def gpt_provider(config, pg_collection, pre_process, post_process, vp_stage=None, *, layer_spec, tied=False):
    from megatron.core.models.gpt import GPTModel

    from lightning_dynatrain import padded_vocab_size

    return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=padded_vocab_size(VOCAB, config),
                    max_sequence_length=SEQ, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                    pg_collection=pg_collection, vp_stage=vp_stage)


def _lm_loss(loss_mask, output):
    losses = output.float().view(-1)
    mask = loss_mask.float().view(-1)
    total = torch.sum(losses * mask)
    return total, mask.sum().to(torch.int), {"lm loss": torch.stack([total.detach(), mask.sum()])}


def gpt_forward_step(data_iterator, model):
    batch = next(data_iterator)
    tokens = batch["tokens"]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    output = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=batch["labels"])
    return output, partial(_lm_loss, torch.ones_like(tokens, dtype=torch.float))


def split_mlp_gpt(layers: int = 2):
    from megatron.core.transformer import TransformerConfig

    from lightning_dynatrain import ModelProvider

    config = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, gated_linear_unit=True, activation_func=F.silu,
                               normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0)
    return ModelProvider(config=config, model_provider=partial(gpt_provider, layer_spec=split_mlp_layer_spec()),
                         forward_step=gpt_forward_step, vocab_size=VOCAB, make_vocab_size_divisible_by=128,
                         seq_length=SEQ, name="split-mlp-gpt")


# ----------------------------------------------------------------------------------------- BERT
def bert_provider(config, pg_collection, pre_process, post_process):
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    from lightning_dynatrain import padded_vocab_size

    return BertModel(config=config, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec,
                     vocab_size=padded_vocab_size(VOCAB, config), max_sequence_length=SEQ,
                     pre_process=pre_process, post_process=post_process, share_embeddings_and_output_weights=True,
                     add_binary_head=True, pg_collection=pg_collection)


def _bert_loss(loss_mask, order, output):
    lm, binary = output  # per-token masked-LM losses, sentence-order logits
    mask = loss_mask.float().view(-1)
    total = torch.sum(lm.float().view(-1) * mask) + F.cross_entropy(binary.float(), order, reduction="sum")
    return total, mask.sum().to(torch.int), {"lm loss": torch.stack([total.detach(), mask.sum()])}


def bert_forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(input_ids=batch["tokens"], attention_mask=batch["padding_mask"], tokentype_ids=batch["types"],
                   lm_labels=batch["labels"])
    return output, partial(_bert_loss, batch["loss_mask"], batch["order"])


def bert():
    from megatron.core.transformer import TransformerConfig

    from lightning_dynatrain import ModelProvider

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return ModelProvider(config=config, model_provider=bert_provider, forward_step=bert_forward_step,
                         vocab_size=VOCAB, make_vocab_size_divisible_by=128, seq_length=SEQ, name="bert")


class MaskedBytes(torch.utils.data.Dataset):
    """BERT samples over the stdlib corpus: every 7th byte of a window masked (label: the byte), the
    halves swapped in odd samples (the sentence-order label), token types 0 then 1."""

    def __init__(self, seq_length: int = SEQ, *, max_bytes: int = 300_000) -> None:
        from lightning_dynatrain.data import StdlibBytes

        self.source = StdlibBytes(seq_length, max_bytes=max_bytes)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        text = self.source[index]["tokens"]
        half = text.shape[0] // 2
        order = index % 2
        if order:
            text = torch.cat([text[half:], text[:half]])
        masked = torch.zeros_like(text, dtype=torch.bool)
        masked[index % 7::7] = True
        return {"tokens": torch.where(masked, MASK_TOKEN, text), "labels": text, "loss_mask": masked.float(),
                "padding_mask": torch.ones_like(text), "types": (torch.arange(text.shape[0]) >= half).long(),
                "order": torch.tensor(order)}


# ------------------------------------------------------------------------------- an MoE of the user's
def sigmoid_moe(layers: int = 2):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from lightning_dynatrain import ModelProvider

    config = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, gated_linear_unit=True, activation_func=F.silu,
                               normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                               moe_router_score_function="sigmoid", moe_router_num_groups=2,
                               moe_router_group_topk=1, moe_router_topk_scaling_factor=2.0,
                               moe_router_load_balancing_type="none", moe_shared_expert_intermediate_size=32,
                               moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall")
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm")
    return ModelProvider(config=config, model_provider=partial(gpt_provider, layer_spec=spec),
                         forward_step=gpt_forward_step, vocab_size=VOCAB, make_vocab_size_divisible_by=128,
                         seq_length=SEQ, name="sigmoid-moe")


__all__ = ["MaskedBytes", "bert", "sigmoid_moe", "split_mlp_gpt", "split_mlp_layer_spec"]
