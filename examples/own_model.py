"""Your own megatron-core model under DynaTrainStrategy: a config, a model provider, a forward step, an
optimizer config and a learning-rate schedule, as Megatron-LM's ``pretrain`` takes them.

    python examples/own_model.py                          # 4 CPU processes, switches at steps 20 and 40
    python examples/own_model.py --devices 2 --layout dp2-tp1-pp1 --schedule 10:dp1-tp2-pp1
    torchrun --nproc-per-node 4 examples/own_model.py     # any launcher, as for the GPT demo

The model is a GPT whose layer spec is the user's: megatron's local spec with the MLP's fused SwiGLU
input projection replaced by two tensor-parallel linears (``GateUpLinear``), which describe their
shards in their own ``sharded_state_dict``. Nothing here tells the strategy how the model is split:
it reads that from megatron's description (``sharded_state_dict``) and moves every tensor at every
switch. With Transformer Engine installed, ``--te`` builds the same model from
``get_gpt_layer_with_transformer_engine_spec`` (on a GPU).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from lightning_dynatrain import (
    DynaTrainOptimizer,
    DynaTrainStrategy,
    MegatronLightningModule,
    ModelProvider,
    ScheduledReconfig,
    padded_vocab_size,
)
from lightning_dynatrain.compat.megatron_versions import mlp_submodules
from lightning_dynatrain.data import StdlibTextDataModule

VOCAB, SEQ = 256, 128


class GateUpLinear(MegatronModule):
    """SwiGLU's input projection as two column-parallel linears (megatron's MLP halves the output)."""

    def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add, is_expert,
                 tp_comm_buffer_name=None, tp_group=None, stride=1, name=None):
        super().__init__(config=config)
        self.tp_group = tp_group
        half = dict(config=config, init_method=init_method, gather_output=gather_output, bias=bias, skip_bias_add=True,
                    is_expert=is_expert, tp_group=tp_group)
        self.gate = ColumnParallelLinear(input_size, output_size // 2, **half)
        self.up = ColumnParallelLinear(input_size, output_size // 2, **half)

    def forward(self, x):
        return torch.cat([self.gate(x)[0], self.up(x)[0]], dim=-1), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"gate.weight": 0, "up.weight": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


def layer_spec(te: bool):
    if te:  # Transformer Engine's layers on GPUs, unchanged
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mlp_submodules(spec).linear_fc1 = GateUpLinear  # megatron-core 0.16 to 0.19
    return spec


def model_provider(config, pg_collection, pre_process, post_process, vp_stage=None, *, te=False, seq=SEQ):
    # vp_stage: the model chunk at a layout with virtual pipeline stages (-vppN), as megatron's builders take it
    return GPTModel(config=config, transformer_layer_spec=layer_spec(te), vocab_size=padded_vocab_size(VOCAB, config),
                    max_sequence_length=seq, pre_process=pre_process, post_process=post_process,
                    position_embedding_type="rope", pg_collection=pg_collection, vp_stage=vp_stage)


def loss_func(output):
    losses = output.float().view(-1)
    total = losses.sum()
    return total, torch.tensor(losses.numel(), dtype=torch.int), {"lm loss": torch.stack([total.detach(),
                                                                                         torch.tensor(losses.numel())])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    tokens = batch["tokens"]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=batch["labels"]), loss_func


class OwnGPT(MegatronLightningModule):
    def __init__(self, provider: ModelProvider, *, max_steps: int, **kwargs):
        super().__init__(provider, **kwargs)
        self.max_steps = max_steps

    def configure_optimizers(self):
        optimizer = DynaTrainOptimizer(OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01,
                                                       clip_grad=1.0))
        warmup = max(1, min(10, self.max_steps // 4))
        schedule = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=warmup,
                                           lr_decay_steps=self.max_steps, lr_decay_style="cosine", start_wd=0.01,
                                           end_wd=0.01, wd_incr_steps=self.max_steps, wd_incr_style="constant")
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def own_provider(*, layers: int = 4, hidden: int = 128, heads: int = 4, ffn: int = 512, seq: int = SEQ,
                 te: bool = False) -> ModelProvider:
    """The model, layout-free: megatron's config without parallel sizes, the provider, the forward step."""
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                               num_query_groups=heads // 2, ffn_hidden_size=ffn, gated_linear_unit=True,
                               activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return ModelProvider(config=config, model_provider=partial(model_provider, te=te, seq=seq),
                         forward_step=forward_step, vocab_size=VOCAB, seq_length=seq, name="own-gpt")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--layout", default="dp2-tp2-pp1")
    p.add_argument("--schedule", default="20:dp1-tp2-pp2,40:dp4-tp1-pp1-zero1")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--te", action="store_true", help="Transformer Engine's layer spec (GPUs)")
    args = p.parse_args()
    module = OwnGPT(own_provider(te=args.te), max_steps=args.max_steps, global_batch_size=16, micro_batch_size=2)
    trainer = Trainer(accelerator="gpu" if args.te else "cpu", devices=args.devices, max_steps=args.max_steps,
                      strategy=DynaTrainStrategy(args.layout), callbacks=[ScheduledReconfig(args.schedule)],
                      logger=False, enable_checkpointing=False, log_every_n_steps=10)
    trainer.fit(module, datamodule=StdlibTextDataModule(seq_length=SEQ, global_batch_size=16, max_bytes=2_000_000))
    if trainer.is_global_zero:
        losses = [loss for _, loss in module.losses]
        print(f"own-gpt: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"{len(trainer.strategy.switch_history)} switches, ending at {trainer.strategy.layout}")


if __name__ == "__main__":
    main()
