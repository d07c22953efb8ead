"""The spawned job behind tests/strategy's MoE, llama-style and indexed-data tests: 4 CPU processes,
real Trainer, real gloo, real megatron, one job for all of them (``run_families4``).

Every fit reads megatron's ``GPTDataset`` over one indexed corpus the parent wrote
(``IndexedDataModule``), in global batches:

1. MoE (``model_shape("moe")``: 4 experts, top-2, dropless, shared expert): expert parallelism up
   (with zero1 on), down together with a dp/tp change, an expert-tensor-parallel change alone, and a
   pipeline change, each at a step boundary in one fit with ``verify=True``; every rank's local
   training state is taken right before and right after each switch, for the parent to assemble
   and compare; then the same steps at the first layout without switches.
2. llama-style (``model_shape("llama")``: GQA, SwiGLU, RMSNorm, untied): three switches with
   ``verify=True`` (the local state taken around each, as for the MoE) and a checkpoint at the
   second; the same steps without switches; and a run resumed from that checkpoint. Every fit
   records, per step, the samples of the global batch and those of this rank's data-parallel share.
3. Sequence parallelism and activation recompute (recipe options) on the llama-style model: full
   recompute with sequence parallelism through switches that turn tp (and with it sequence
   parallelism) off and on again, the local state taken around each; selective recompute without
   switches. Each records the megatron config it ran with at every step.
4. Megatron's router: the buffers a ``TopKRouter`` keeps outside the optimizer with the MoE
   family's options, and with the options that add some.

Lightning sees ``LOCAL_RANK`` (so it launches nothing) and finds ``torch.distributed`` initialised.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.dist import run_distributed
from tests.strategy.logical_state import local_state

SIZE = dict(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32,
            make_vocab_size_divisible_by=128)  # the same padded vocabulary (256) at tp1 and tp2
GLOBAL_BATCH, MICRO_BATCH, SEED = 8, 1, 1234
#: see tests/strategy/jobs.py: Adam's epsilon for comparisons over many steps
EPS = 1e-6

MOE_START = "dp4-tp1-pp1-ep2"
MOE_SCHEDULE = {
    2: "dp4-tp1-pp1-ep4-zero1",       # ep up (zero1 on)
    4: "dp2-tp2-pp1-ep2",             # ep down with a dp/tp change (etp follows tp: 1 -> 2)
    6: "dp2-tp2-pp1-ep2-etp1-zero1",  # etp 2 -> 1 alone (and zero1 on)
    8: "dp2-tp1-pp2-ep2",             # a pipeline and tp change under the experts
}
MOE_STEPS = 10

LLAMA_START = "dp2-tp2-pp1"
LLAMA_SCHEDULE = {3: "dp1-tp2-pp2-zero1", 6: "dp4-tp1-pp1", 9: "dp2-tp1-pp2"}
LLAMA_STEPS = 12
#: the llama run checkpoints here (after that step's switch); a second run resumes from it
RESUME_AT = 6

#: sequence parallel at tp2, off at tp1, on again (the llama start and steps, to compare with its static run)
EXEC_SCHEDULE = {3: "dp1-tp2-pp2-zero1", 6: "dp4-tp1-pp1", 9: "dp2-tp2-pp1-zero1"}


def _module(family: str, steps: int, **options):
    from lightning_dynatrain.megatron.shapes import model_shape
    from lightning_dynatrain.strategy import GPTLightningModule

    return GPTLightningModule(model_shape(family, **SIZE), lr=3e-3, weight_decay=0.01, global_batch_size=GLOBAL_BATCH,
                              micro_batch_size=MICRO_BATCH, warmup_steps=2, max_steps=steps, seed=SEED, eps=EPS,
                              **options)


def _data(corpus: str):
    from lightning_dynatrain.data import IndexedDataModule

    return IndexedDataModule(corpus, seq_length=SIZE["seq_length"], global_batch_size=GLOBAL_BATCH, seed=0)


def _trainer(layout: str, steps: int, callbacks: list, **kwargs):
    from lightning.pytorch import Trainer

    from lightning_dynatrain.strategy import DynaTrainStrategy

    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    defaults.update(kwargs)
    strategy = DynaTrainStrategy(layout, verify=True)
    return Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, callbacks=callbacks, **defaults)


def _callbacks(schedule: dict) -> tuple[list, dict]:
    """``[state before, ScheduledReconfig, state after, rows seen]`` (Lightning runs them in this order)
    and what they record: ``{"before": {step: state}, "after": {step: state}, "seen": [...]}``."""
    from lightning.pytorch.callbacks import Callback

    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.runtime.steps import local_share

    record: dict = {"before": {}, "after": {}, "seen": []}

    class LocalState(Callback):
        def __init__(self, side: str):
            self.side = side

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in schedule:
                record[self.side][trainer.global_step] = local_state(trainer.strategy)

    class RowsSeen(Callback):
        """The dataset samples of the rows this rank trains on at each step, cut as the step cuts them."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            s = trainer.strategy
            share = local_share(batch, dp_rank=s.megatron.dp_rank, dp_size=s.megatron.dp_size,
                                global_batch_size=GLOBAL_BATCH)
            record["seen"].append((trainer.global_step, str(s.layout), s.megatron.dp_rank,
                                   share["sample"].tolist(), batch["sample"].tolist()))

    class ConfigSeen(Callback):
        """The megatron config each step runs with: sequence parallel, recompute granularity."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            config = trainer.strategy.megatron.model.config
            record["config"].append((trainer.global_step, str(trainer.strategy.layout), config.sequence_parallel,
                                     config.recompute_granularity))

    record["config"] = []
    callbacks = [LocalState("before"), ScheduledReconfig(schedule), LocalState("after"), RowsSeen()] if schedule \
        else [RowsSeen()]
    return callbacks + [ConfigSeen()], record


def _fit(family: str, layout: str, schedule: dict, steps: int, corpus: str, ckpt_path=None, extra=(), options=None,
         **kwargs) -> dict:
    module = _module(family, steps, **(options or {}))
    callbacks, record = _callbacks(schedule)
    trainer = _trainer(layout, steps, callbacks + list(extra), **kwargs)
    trainer.fit(module, datamodule=_data(corpus), ckpt_path=ckpt_path)
    strategy = trainer.strategy
    return dict(record, losses=[loss for _, loss in module.losses], global_step=trainer.global_step,
                history=[(h.step, h.src, h.dst) for h in strategy.switch_history],
                dtypes=sorted({str(p.dtype) for p in module.model.parameters()}))


def _moe(results: dict, corpus: str) -> None:
    results["moe"] = dict(switched=_fit("moe", MOE_START, MOE_SCHEDULE, MOE_STEPS, corpus),
                          static=_fit("moe", MOE_START, {}, MOE_STEPS, corpus))


def _llama(results: dict, corpus: str, tmp: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=tmp, every_n_train_steps=RESUME_AT, save_top_k=-1, save_last=False)
    switched = _fit("llama", LLAMA_START, LLAMA_SCHEDULE, LLAMA_STEPS, corpus, extra=[ckpt], enable_checkpointing=True)
    path = next(tmp.glob(f"*step={RESUME_AT}.ckpt"))
    resumed = _fit("llama", LLAMA_SCHEDULE[RESUME_AT], LLAMA_SCHEDULE, LLAMA_STEPS, corpus, ckpt_path=path)
    static = _fit("llama", LLAMA_START, {}, LLAMA_STEPS, corpus)
    results["llama"] = dict(switched=switched, resumed=resumed, static=static)


def _execution(results: dict, corpus: str) -> None:
    results["execution"] = dict(
        full=_fit("llama", LLAMA_START, EXEC_SCHEDULE, LLAMA_STEPS, corpus,
                  options=dict(sequence_parallel=True, recompute="full")),
        selective=_fit("llama", LLAMA_START, {}, LLAMA_STEPS, corpus, options=dict(recompute="selective")))


def _router_buffers(results: dict) -> None:
    """The buffers (state outside the optimizer) of megatron's ``TopKRouter`` built with the MoE
    family's options, and with the two options that give it some: expert bias (aux-loss-free
    balancing) and the global-batch auxiliary loss."""
    from dataclasses import replace

    from megatron.core.transformer.moe.router import TopKRouter

    from lightning_dynatrain.devices.host.megatron_patches import megatron_on_cpu
    from lightning_dynatrain.megatron.gpt import transformer_config
    from lightning_dynatrain.megatron.parallel_state_adapter import (
        current_process_groups,
        destroy,
        initialize_for_layout,
    )
    from lightning_dynatrain.megatron.shapes import model_shape
    from lightning_dynatrain.vps.layout import ParallelConfig

    layout = ParallelConfig.parse(MOE_START)
    initialize_for_layout(layout, seed=SEED)
    config = transformer_config(model_shape("moe", **SIZE), layout)
    variants = {
        "family": config,
        "expert_bias": replace(config, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
        "global_aux_loss": replace(config, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-2),
    }
    out = {}
    for name, cfg in variants.items():
        with megatron_on_cpu():
            router = TopKRouter(config=cfg, pg_collection=current_process_groups())
        out[name] = dict(buffers=sorted((n, tuple(b.shape), n in router.state_dict()) for n, b in router.named_buffers()),
                         options=(cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff,
                                  cfg.moe_router_enable_expert_bias, cfg.moe_router_score_function))
    destroy()
    results["router"] = out


def _families_job(rank: int, world_size: int, tmp: str, corpus: str) -> dict:
    import torch

    os.environ["LOCAL_RANK"] = str(rank)  # Lightning then launches nothing: the harness made the processes
    os.environ["NODE_RANK"] = "0"
    torch.set_num_threads(1)
    results: dict = {}
    _moe(results, corpus)
    _llama(results, corpus, Path(tmp) / "ckpt")
    _execution(results, corpus)
    _router_buffers(results)
    return results


def run_families4(tmp: str) -> tuple[list[dict], str]:
    """Write the corpus, run the job; the per-rank results and the corpus's path prefix."""
    from lightning_dynatrain.data.indexed import write_indexed_corpus
    from tests.strategy.texts import generated_documents

    corpus = write_indexed_corpus(generated_documents(), Path(tmp) / "corpus" / "text").path_prefix
    return run_distributed(_families_job, 4, tmp, corpus, timeout_s=420, collective_timeout_s=180), corpus
