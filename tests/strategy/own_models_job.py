"""The spawned job behind tests/strategy/test_own_models.py: models of the user's (``own_models``)
trained by ``MegatronLightningModule`` under ``DynaTrainStrategy``, 4 CPU processes, real Trainer,
real gloo, real megatron, one job for all of them (``run_own_models4``).

Per model: a fit with scheduled switches over dp/tp/pp (and ep for the MoE; pipelines with uneven
stages for the split-MLP GPT and the MoE, virtual stages with ZeRO-1 for the GPT), ``verify=True``,
every rank's training state described by megatron itself (``tests/megatron_description.py``) right
before and right after each switch; then the same steps at the first layout without switches. The
split-MLP GPT (bf16, megatron's ``OptimizerParamScheduler``) also saves a checkpoint after one
switch (at virtual stages with ZeRO-1), and a second fit resumes from it at the plain first layout;
its static run saves too, and a third fit resumes that at virtual stages (each time the state
described at the save and as the new fit starts). It and the MoE enter a rollout phase
(``ROLLOUTS``; the GPT's weights freed and optimizer parked, the MoE's experts at another ep): the
state described before and after it, the rollout model's weights, what it generated, a switch
asked for inside it. The BERT runs a torch ``LambdaLR``, the MoE a constant rate. Every rank
returns the spec the strategy read from its model.

Lightning sees ``LOCAL_RANK`` (so it launches nothing) and finds ``torch.distributed`` initialised.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.dist import run_distributed
from tests.megatron_description import describe
from tests.strategy.own_models import GLOBAL_BATCH, MICRO_BATCH, SEQ

SEED, STEPS, EPS = 1234, 8, 1e-6
#: per model: its layers, the first layout, the switches (uneven pipelines among them: the split-MLP
#: GPT's 4 layers 1+3, then one layer in each of two chunks per stage with ZeRO-1, then 2+2; the
#: MoE's 4 layers in two chunks of one per stage, its experts over two ranks), the precision
CASES = {
    "split-mlp": dict(layers=4, start="dp2-tp2-pp1",
                      schedule={2: "dp1-tp2-pp2-first1", 4: "dp2-tp1-pp2-vpp2-zero1", 6: "dp2-tp1-pp2"},
                      precision="bf16-mixed"),
    "bert": dict(layers=2, start="dp4-tp1-pp1", schedule={2: "dp2-tp2-pp1", 4: "dp1-tp2-pp2", 6: "dp2-tp1-pp2"},
                 precision="32-true"),
    "sigmoid-moe": dict(layers=4, start="dp4-tp1-pp1-ep2",
                        schedule={2: "dp2-tp2-pp1-ep2", 4: "dp4-tp1-pp1-ep4-zero1", 6: "dp2-tp1-pp2-vpp2-ep2"},
                        precision="32-true"),
}
#: the split-MLP fit saves here (after the switch of that step: at virtual stages); a second fit resumes
#: from it at the first layout; the static run saves here too, and a third fit resumes that at virtual stages
RESUME_AT, RESUME_AT_VPP = 4, "dp1-tp2-pp2-vpp2"
#: fits that enter a rollout phase: after this step, at this layout, parked so, the weights kept or not
#: (the split-MLP GPT from dp2-tp1-pp2-vpp2-zero1 to other virtual stages, bf16, its weights freed; the MoE
#: from dp2-tp2-pp1-ep2, ep 2 -> 4)
ROLLOUTS = {"split-mlp": (5, "dp1-tp2-pp2-vpp2", "host", False),
            "sigmoid-moe": (3, "dp4-tp1-pp1-ep4", "in_place", True)}


def _module(name: str):
    import torch
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from lightning_dynatrain import DynaTrainOptimizer, MegatronLightningModule
    from tests.strategy import own_models

    class SplitMLP(MegatronLightningModule):
        def configure_optimizers(self):
            optimizer = DynaTrainOptimizer(OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01,
                                                           adam_eps=EPS, clip_grad=1.0))
            schedule = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2,
                                               lr_decay_steps=STEPS, lr_decay_style="cosine", start_wd=0.01,
                                               end_wd=0.05, wd_incr_steps=STEPS, wd_incr_style="linear")
            return {"optimizer": optimizer, "lr_scheduler": schedule}

    class Bert(MegatronLightningModule):
        def configure_optimizers(self):
            optimizer = DynaTrainOptimizer(OptimizerConfig(optimizer="sgd", lr=0.5, sgd_momentum=0.9,
                                                           weight_decay=0.01))
            return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** (step // 3))]

    batches = dict(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=SEED)
    layers = CASES[name]["layers"]
    if name == "split-mlp":
        return SplitMLP(own_models.split_mlp_gpt(layers), **batches)
    if name == "bert":
        return Bert(own_models.bert(), **batches)
    return MegatronLightningModule(own_models.sigmoid_moe(layers), **batches, optimizer=OptimizerConfig(
        optimizer="adam", lr=3e-3, weight_decay=0.01, adam_eps=EPS))


def _data(name: str):
    from lightning_dynatrain.data import GlobalBatchDataModule, StdlibTextDataModule
    from tests.strategy.own_models import MaskedBytes

    if name == "bert":
        return GlobalBatchDataModule(MaskedBytes(SEQ), global_batch_size=GLOBAL_BATCH, seed=0)
    return StdlibTextDataModule(seq_length=SEQ, global_batch_size=GLOBAL_BATCH, seed=0, max_bytes=300_000)


def _trainer(layout: str, steps: int, precision: str, callbacks: list, **kwargs):
    from lightning.pytorch import Trainer

    from lightning_dynatrain.strategy import DynaTrainStrategy

    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    defaults.update(kwargs)
    return Trainer(accelerator="cpu", devices=4, strategy=DynaTrainStrategy(layout, verify=True), max_steps=steps,
                   precision=precision, callbacks=callbacks, **defaults)


def _callbacks(schedule: dict, save: Path | None = None, rollout_at: tuple | None = None,
               describe_start: bool = False) -> tuple[list, dict]:
    """``[state before, ScheduledReconfig, state after (and a save and a rollout)]`` and what they
    record (with ``describe_start``, also the state training starts from: a resumed checkpoint's)."""
    from lightning.pytorch.callbacks import Callback

    from lightning_dynatrain.callbacks import ScheduledReconfig
    from tests.megatron_description import describe_model

    record: dict = {"before": {}, "after": {}, "lr": []}

    def rollout(strategy) -> dict:
        import torch

        out = {"before": describe(strategy.megatron)}
        prompts = torch.arange(4 * 6).reshape(4, 6) % 200
        _, layout, park, keep_weights = rollout_at
        with strategy.rollout(layout, park=park, keep_weights=keep_weights) as policy:
            out["model"] = describe_model(policy.model)
            generated = policy.generate(prompts, max_new_tokens=3, temperature=1.0, seed=5)
            out["generated"] = (generated.tokens.numpy(), generated.log_probs.numpy())  # (plain data for the parent)
            out["scored"] = policy.log_probs(generated.tokens).numpy()
            try:
                strategy.reconfigure("dp4-tp1-pp1")
            except Exception as err:  # noqa: BLE001 (what was raised is the record)
                out["refused"] = type(err).__name__
        out["after"] = describe(strategy.megatron)
        out["parked_bytes"] = policy.figures.parked_bytes
        return out

    class LocalState(Callback):
        def __init__(self, side: str):
            self.side = side

        def on_train_start(self, trainer, pl_module):
            if describe_start and self.side == "after":
                record["start"] = describe(trainer.strategy.megatron)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step in schedule:
                record[self.side][step] = describe(trainer.strategy.megatron)
            if self.side == "after":
                record["lr"].append(tuple(trainer.strategy.optimizer_handle.scheduled))
                if save is not None and step == RESUME_AT:
                    trainer.save_checkpoint(save)
                    record["saved"] = describe(trainer.strategy.megatron)
                if rollout_at is not None and step == rollout_at[0]:
                    record["rollout"] = rollout(trainer.strategy)

    return [LocalState("before"), ScheduledReconfig(schedule), LocalState("after")], record


def _fits(name: str, tmp: Path) -> dict:
    case = CASES[name]
    out: dict = {}
    save = tmp / f"{name}.ckpt" if name == "split-mlp" else None
    callbacks, record = _callbacks(case["schedule"], save, ROLLOUTS.get(name))
    module = _module(name)
    trainer = _trainer(case["start"], STEPS, case["precision"], callbacks)
    trainer.fit(module, datamodule=_data(name))
    strategy = trainer.strategy
    out["switched"] = dict(losses=[loss for _, loss in module.losses], history=[(r.step, r.src, r.dst)
                           for r in strategy.switch_history], spec=strategy.recipe.model.spec(), **record,
                           ahead=[r.ahead_build_seconds is not None for r in strategy.switch_history],
                           refusals=list(callbacks[1].refusals),
                           dtypes=sorted({str(p.dtype) for p in module.model.parameters()}))
    static = _module(name)
    static_save = tmp / f"{name}-static.ckpt" if save is not None else None
    callbacks, static_record = _callbacks({}, static_save) if save is not None else ([], {})
    _trainer(case["start"], STEPS, case["precision"], callbacks).fit(static, datamodule=_data(name))
    out["static"] = dict(losses=[loss for _, loss in static.losses], saved=static_record.get("saved"))
    if save is not None:  # the switched run's save (at virtual stages) resumed at the plain start layout ...
        resumed = _module(name)
        callbacks, resumed_record = _callbacks(case["schedule"], describe_start=True)
        trainer = _trainer(case["start"], STEPS, case["precision"], callbacks)
        trainer.fit(resumed, datamodule=_data(name), ckpt_path=save)
        out["resumed"] = dict(losses=[loss for _, loss in resumed.losses], lr=resumed_record["lr"],
                              layouts=[str(trainer.strategy.layout)], start=resumed_record["start"])
        # ... and the static run's save (at the plain start layout) resumed at virtual stages
        resumed = _module(name)
        callbacks, resumed_record = _callbacks({}, describe_start=True)
        trainer = _trainer(RESUME_AT_VPP, STEPS, case["precision"], callbacks)
        trainer.fit(resumed, datamodule=_data(name), ckpt_path=static_save)
        out["resumed_at_vpp"] = dict(losses=[loss for _, loss in resumed.losses], start=resumed_record["start"],
                                     layouts=[str(trainer.strategy.layout)])
    return out


def _job(rank: int, world_size: int, tmp: str, names: tuple[str, ...]) -> dict:
    import torch

    os.environ["LOCAL_RANK"] = str(rank)  # Lightning then launches nothing: the harness made the processes
    os.environ["NODE_RANK"] = "0"
    torch.set_num_threads(1)
    return {name: _fits(name, Path(tmp)) for name in names}


def run_own_models4(tmp: str, names: tuple[str, ...] = tuple(CASES)) -> list[dict]:
    return run_distributed(_job, 4, tmp, names, timeout_s=900, collective_timeout_s=300)


__all__ = ["CASES", "RESUME_AT", "RESUME_AT_VPP", "ROLLOUTS", "STEPS", "run_own_models4"]
