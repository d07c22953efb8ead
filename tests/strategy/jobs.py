"""The multi-process jobs behind tests/strategy: real Trainer, real gloo, real megatron, 4 CPU processes.

One spawned job (``run_world4``) runs several ``Trainer.fit`` calls in the same 4 processes (each fit
sets up and tears down megatron's groups; the gloo WORLD belongs to the harness and stays):

1. loss parity: 5 steps at each of ``PARITY_LAYOUTS`` from the same seed and the same global batches;
2. resume: 3 steps at dp2-pp2-zero1 with a per-rank checkpoint of an earlier version, then a resumed fit
   to step 5 (layout-free checkpoints: ``checkpoint_job.py``);
3. schedule validation: a bad layout at step 5000 and a layout of another world size, both refused at setup;
   a scheduled switch over ``switch_memory_limit``, refused when it comes, before anything moved;
4. switching: 30 steps with real hot switches (a request made inside step 2 is deferred to its end,
   schedule entries fire at the step boundary), ``verify=True`` fingerprinting the full logical state
   around each switch, against 30 steps at the first layout without any switch;
5. bf16: ``Trainer(precision="bf16-mixed")`` with scheduled switches (``verify=True``) against a
   static bf16 run.

Lightning sees ``LOCAL_RANK`` (so it launches nothing) and finds ``torch.distributed`` initialised.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.dist import run_distributed

SHAPE = dict(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32,
             make_vocab_size_divisible_by=128)
GLOBAL_BATCH, MICRO_BATCH, STEPS, SEED = 8, 1, 5, 1234
PARITY_LAYOUTS = ["dp4-tp1-pp1", "dp2-tp2-pp1", "dp1-tp2-pp2", "dp2-tp1-pp2-zero1"]
#: the switching run: layouts in order, and the steps at which they start (a mid-step request, then the schedule)
SWITCH_LAYOUTS = ["dp4-tp1-pp1", "dp2-tp2-pp1", "dp1-tp2-pp2-zero1", "dp2-tp1-pp2"]
SWITCH_AT = [0, 2, 12, 22]
SWITCH_STEPS = 30
#: Adam's epsilon for the 30-step comparison: with 1e-8, elements whose gradient is rounding noise take
#: full +-lr steps whose sign depends on the layout's summation order, and the runs drift apart
SWITCH_EPS = 1e-6


def _module(**overrides):
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.strategy import GPTLightningModule

    kwargs = dict(lr=3e-3, weight_decay=0.01, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                  warmup_steps=2, max_steps=STEPS, seed=SEED)
    kwargs.update(overrides)
    return GPTLightningModule(GPTShape(**SHAPE), **kwargs)


def _data():
    from lightning_dynatrain.data import StdlibTextDataModule

    return StdlibTextDataModule(seq_length=SHAPE["seq_length"], global_batch_size=GLOBAL_BATCH, shuffle=True,
                                seed=0, max_bytes=300_000)


def _trainer(strategy, max_steps: int, **kwargs):
    from lightning.pytorch import Trainer

    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    defaults.update(kwargs)
    return Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=max_steps, **defaults)


def _error_of(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as err:  # the test asserts the type and the text
        return type(err).__name__, str(err)
    return "", ""


def _probe():
    from lightning.pytorch.callbacks import Callback

    class Probe(Callback):
        """What the strategy says at the start of each batch: step, layout, dp size, micro-batches, sampler kwargs."""

        def __init__(self):
            self.seen = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            s = trainer.strategy
            self.seen.append((trainer.global_step, str(s.layout), s.megatron.dp_size, s.num_microbatches,
                              s.distributed_sampler_kwargs, tuple(batch["tokens"].shape)))

    return Probe()


def _parity(results: dict) -> None:
    from lightning_dynatrain.strategy import DynaTrainStrategy

    for layout in PARITY_LAYOUTS:
        module, strategy, probe = _module(), DynaTrainStrategy(layout), _probe()
        trainer = _trainer(strategy, STEPS, callbacks=[probe])
        trainer.fit(module, datamodule=_data())
        results[("parity", layout)] = dict(
            losses=[loss for _, loss in module.losses], global_step=trainer.global_step, seen=probe.seen,
            env=type(strategy.cluster_environment).__name__,
        )


def _per_rank_saver(path: Path, at_step: int):
    """A callback writing the per-rank checkpoint earlier versions wrote (``checkpoint.legacy``) after
    ``at_step`` steps, as ``ModelCheckpoint`` did: Lightning's dict with this rank's model shard and
    optimizer state dicts."""
    from lightning.pytorch.callbacks import Callback

    from lightning_dynatrain.checkpoint.legacy import save_rank_checkpoint

    class PerRankSaver(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != at_step:
                return
            strategy = trainer.strategy
            checkpoint = trainer._checkpoint_connector.dump_checkpoint()
            checkpoint["state_dict"] = pl_module.state_dict()
            checkpoint["optimizer_states"] = [strategy.optimizers[0].state_dict()]
            save_rank_checkpoint(checkpoint, path, rank=strategy.global_rank, layout=strategy.layout,
                                 world_size=strategy.world_size)

    return PerRankSaver()


def _resume(results: dict, tmp: Path) -> None:
    """A per-rank checkpoint of an earlier version: resumed at its layout; refused at another."""
    from lightning_dynatrain.strategy import DynaTrainStrategy

    layout, path = PARITY_LAYOUTS[-1], tmp / "epoch=0-step=3.ckpt"
    first = _module()
    _trainer(DynaTrainStrategy(layout), 3, callbacks=[_per_rank_saver(path, 3)]).fit(first, datamodule=_data())
    second = _module()
    trainer = _trainer(DynaTrainStrategy(layout), STEPS)
    trainer.fit(second, datamodule=_data(), ckpt_path=path)
    wrong = _error_of(lambda: _trainer(DynaTrainStrategy("dp4"), STEPS).fit(_module(), datamodule=_data(),
                                                                            ckpt_path=path))
    results["resume"] = dict(losses=[l for _, l in first.losses] + [l for _, l in second.losses],
                             files=sorted(p.name for p in path.iterdir()), wrong_layout=wrong)


def _validation(results: dict) -> None:
    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.strategy import DynaTrainStrategy

    for name, schedule in (("far", {2: "dp2-tp2-pp1", 5000: "dp1-tp1-pp4"}), ("world", "10:dp2-tp1-pp1"),
                           ("batch", {7: "dp4-tp1-pp1-zero1"})):
        module = _module(micro_batch_size=4) if name == "batch" else _module()
        trainer = _trainer(DynaTrainStrategy("dp2-tp2-pp1"), STEPS, callbacks=[ScheduledReconfig(schedule)])
        results[("refused", name)] = (*_error_of(lambda: trainer.fit(module, datamodule=_data())),
                                      trainer.global_step, module.model is None)


def _memory_refusal(results: dict) -> None:
    """A scheduled switch over ``switch_memory_limit`` stops fit with SwitchMemoryError before anything
    moved: the strategy still runs the old layout, and its state still trains."""
    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.strategy import DynaTrainStrategy

    module = _module()
    strategy = DynaTrainStrategy("dp2-tp2-pp1", switch_memory_limit=1024)
    trainer = _trainer(strategy, STEPS, callbacks=[ScheduledReconfig({2: "dp4-tp1-pp1"}, on_refused="raise")])
    kind, text = _error_of(lambda: trainer.fit(module, datamodule=_data()))
    results["memory_refusal"] = dict(kind=kind, text=text, global_step=trainer.global_step, layout=str(strategy.layout),
                                     history=len(strategy.switch_history), losses=[l for _, l in module.losses])
    # the default: the refusal is a warning and a record, and training goes on at the old layout
    module, strategy = _module(), DynaTrainStrategy("dp2-tp2-pp1", switch_memory_limit=1024)
    schedule = ScheduledReconfig({2: "dp4-tp1-pp1"})
    trainer = _trainer(strategy, STEPS, callbacks=[schedule])
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kind, _ = _error_of(lambda: trainer.fit(module, datamodule=_data()))
    results["memory_refusal_continue"] = dict(
        kind=kind, global_step=trainer.global_step, layout=str(strategy.layout), refusals=schedule.refusals,
        state=schedule.state_dict(), losses=[l for _, l in module.losses],
        warned=[str(w.message) for w in caught if "was refused" in str(w.message)])


def _switching(results: dict, tmp: Path) -> None:
    """Real hot switches inside fit (``verify=True`` fingerprints the logical state around each), and
    the same training at the first layout without switches, for the loss comparison."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import CSVLogger

    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.megatron.state_bridge import adam_step
    from lightning_dynatrain.strategy import DynaTrainStrategy

    class AskMidStep(Callback):
        """Requests a switch from inside step 2 (``on_before_optimizer_step`` runs within training_step)."""

        def __init__(self):
            self.answers = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:
                self.answers.append(trainer.strategy.reconfigure("dp2-tp2-pp1"))
                self.answers.append(str(trainer.strategy.pending_layout))

    class Scalars(Callback):
        """Adam's step count and the learning rates each optimizer step used (called right after it)."""

        def __init__(self):
            self.seen = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            opt = trainer.strategy.megatron.optimizer
            lrs = {g["lr"] for g in opt.param_groups}
            self.seen.append((trainer.global_step, adam_step(opt), sorted(lrs)))

    ask, watch, scalars = AskMidStep(), _probe(), Scalars()
    logger = CSVLogger(tmp, name="switching", version=0, flush_logs_every_n_steps=1)
    strategy = DynaTrainStrategy(SWITCH_LAYOUTS[0], verify=True, staging_budget="64KiB")
    module = _module(max_steps=SWITCH_STEPS, eps=SWITCH_EPS)
    schedule = ScheduledReconfig({SWITCH_AT[2]: SWITCH_LAYOUTS[2], SWITCH_AT[2] + 1: SWITCH_LAYOUTS[2],
                                  SWITCH_AT[3]: SWITCH_LAYOUTS[3]})
    trainer = _trainer(strategy, SWITCH_STEPS, logger=logger, callbacks=[ask, watch, scalars, schedule])
    trainer.fit(module, datamodule=_data())
    noop = strategy.reconfigure(strategy.layout)  # after fit: the no-op path needs no groups
    metrics = (tmp / "switching" / "version_0" / "metrics.csv")

    static, static_scalars = _module(max_steps=SWITCH_STEPS, eps=SWITCH_EPS), Scalars()
    _trainer(DynaTrainStrategy(SWITCH_LAYOUTS[0]), SWITCH_STEPS, callbacks=[static_scalars]).fit(
        static, datamodule=_data())
    results["switching"] = dict(
        answers=ask.answers, seen=watch.seen, scalars=scalars.seen, static_scalars=static_scalars.seen,
        losses=[l for _, l in module.losses],
        static=[l for _, l in static.losses], history=[r.to_json() for r in strategy.switch_history],
        noop=noop.to_json(), metrics=metrics.read_text() if metrics.exists() else None,
    )


#: the bf16-mixed run: megatron's bf16 params with fp32 main params (norms fp32), switched across
#: dp/tp/pp and zero1 on and off, against the same steps at its first layout
BF16_SCHEDULE = {4: "dp1-tp2-pp2-zero1", 8: "dp4-tp1-pp1", 10: "dp2-tp1-pp2-zero1"}
BF16_STEPS = 12


def _bf16_switching(results: dict) -> None:
    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.strategy import DynaTrainStrategy

    runs = {}
    for name, callbacks in (("switched", [ScheduledReconfig(BF16_SCHEDULE)]), ("static", [])):
        module, strategy = _module(max_steps=BF16_STEPS, eps=SWITCH_EPS), DynaTrainStrategy("dp2-tp2-pp1", verify=True)
        _trainer(strategy, BF16_STEPS, precision="bf16-mixed", callbacks=callbacks).fit(module, datamodule=_data())
        runs[name] = dict(losses=[l for _, l in module.losses], plugin=repr(strategy.precision_plugin),
                          dtypes=sorted({str(p.dtype) for p in module.model.parameters()}),
                          history=[(h.step, h.src, h.dst) for h in strategy.switch_history])
    results["bf16"] = runs


def _world4_job(rank: int, world_size: int, tmp: str) -> dict:
    import torch

    os.environ["LOCAL_RANK"] = str(rank)  # Lightning then launches nothing: the harness made the processes
    os.environ["NODE_RANK"] = "0"
    torch.set_num_threads(1)
    results: dict = {}
    _parity(results)
    _validation(results)
    _memory_refusal(results)
    _resume(results, Path(tmp) / "ckpt")
    _switching(results, Path(tmp) / "logs")
    _bf16_switching(results)
    return results


def run_world4(tmp: str) -> list[dict]:
    return run_distributed(_world4_job, 4, tmp, timeout_s=420, collective_timeout_s=180)
