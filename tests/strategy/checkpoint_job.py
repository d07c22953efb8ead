"""The multi-process jobs behind tests/strategy/test_checkpoints.py: real Trainer, gloo, megatron, DCP files.

``run_checkpoint4`` (4 processes) runs, in order:

1. ``straight``: 8 steps at dp2-tp2-pp1-zero1, a checkpoint saved after step 3 (each rank's local
   state recorded at that moment), with a ``ScheduledReconfig`` entry at step 2 and a counting
   callback, whose states the checkpoint carries;
2. ``resume``: from that checkpoint to step 8 at dp2-tp2-pp1-zero1, dp4 and dp1-tp2-pp2, each rank's
   local state recorded as training starts;
3. ``bf16``: the same at bf16-mixed (4 steps, saved after 2), resumed at dp1-tp2-pp2-zero1;
4. ``megatron``: 2 steps, then megatron's ``dist_checkpointing`` writes the state (distributed
   optimizer, ``fully_reshardable``); a plain megatron load of it at dp1-tp2-pp2-zero1 and its first
   loss; fits started from it (``init_from_megatron``) at that layout and at dp2-tp1-pp2 (zero0,
   which megatron itself cannot load it into);
5. ``keeper``: ``ModelCheckpoint`` (top 2 by loss, ``save_last``) with background saves for 4 steps,
   then ``fit(ckpt_path="last")`` to step 6;
6. ``validate``: ``trainer.validate(ckpt_path=...)``, which builds no optimizer: the parameters;
7. ``refused``: another model, a directory that is no checkpoint, a megatron checkpoint as ``ckpt_path``.

``run_checkpoint2`` (2 processes) resumes the checkpoint of 1. at dp2 and records the same.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.dist import run_distributed
from tests.strategy.jobs import SHAPE, _data, _error_of, _module, _trainer

LAYOUT = "dp2-tp2-pp1-zero1"
SAVE_AT, TOTAL = 3, 8
RESUME_LAYOUTS = ["dp2-tp2-pp1-zero1", "dp4-tp1-pp1", "dp1-tp2-pp2"]
BF16_SAVE_AT, BF16_TOTAL, BF16_RESUME = 2, 4, "dp1-tp2-pp2-zero1"
MEGATRON_STEPS, MEGATRON_PLAIN, MEGATRON_ZERO0 = 2, "dp1-tp2-pp2-zero1", "dp2-tp1-pp2"
KEEPER_FIRST, KEEPER_THEN = 4, 6


def local_state(strategy) -> dict:
    """This rank's local training state, as bits: every tensor keyed as the engine keys it, Adam's
    step and each kind of param group's settings."""
    import torch
    import torch.distributed as dist

    from lightning_dynatrain.megatron.optimizer import group_settings
    from lightning_dynatrain.megatron.state_bridge import adam_step, megatron_store, param_store

    spec, rank, state = strategy.recipe.model.spec(), dist.get_rank(), strategy.megatron_or_none
    if state is None or adam_step(state.optimizer) is None:  # no optimizer, or no Adam state yet
        store, step, groups = param_store(strategy.model_shard, spec, strategy.layout, rank), None, None
    else:
        store = megatron_store(state.ddp, state.optimizer, spec, state.layout, rank)
        step, groups = adam_step(state.optimizer), group_settings(state.optimizer)
    ints = {2: torch.int16, 4: torch.int32}
    tensors = {k: t.detach().cpu().contiguous().view(-1).view(ints[t.element_size()]).numpy().copy()
               for k, t in store.items()}
    return {"layout": str(strategy.layout), "tensors": tensors, "step": step, "groups": groups}


def _callbacks(save_at: int | None = None, path: Path | None = None):
    from lightning.pytorch.callbacks import Callback

    class Record(Callback):
        """Records the local state where the run starts training, and after ``save_at`` steps saves
        a checkpoint and records the state it saved; counts batches (state a checkpoint carries)."""

        def __init__(self):
            self.batches, self.at_start, self.saved, self.layouts, self.restored_batches = 0, None, None, [], None

        def on_train_start(self, trainer, pl_module):
            self.at_start = local_state(trainer.strategy)
            self.restored_batches = self.batches

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.layouts.append(str(trainer.strategy.layout))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.batches += 1
            if trainer.global_step == save_at:
                trainer.save_checkpoint(path)
                self.saved = local_state(trainer.strategy)

        def state_dict(self):
            return {"batches": self.batches}

        def load_state_dict(self, state_dict):
            self.batches = state_dict["batches"]

    return Record()


def _fit(layout: str, steps: int, *, ckpt_path=None, record=None, precision="32-true", extra=(), **strategy_kw):
    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.strategy import DynaTrainStrategy

    record = record or _callbacks()
    module = _module(max_steps=TOTAL)
    # a no-op switch at step 2, marked done before ``record`` saves (callbacks run in this order): a
    # run resumed at another layout must not switch back to LAYOUT at its start
    callbacks = [ScheduledReconfig({2: LAYOUT}), record, *extra]
    trainer = _trainer(DynaTrainStrategy(layout, **strategy_kw), steps, precision=precision, callbacks=callbacks,
                       enable_checkpointing=any(type(c).__name__ == "ModelCheckpoint" for c in extra))
    trainer.fit(module, datamodule=_data(), ckpt_path=ckpt_path)
    return dict(losses=[l for _, l in module.losses], at_start=record.at_start, saved=record.saved,
                layouts=record.layouts, batches=record.restored_batches, global_step=trainer.global_step)


def _straight_and_resumes(results: dict, tmp: Path) -> None:
    path = tmp / "step3.ckpt"
    results["straight"] = _fit(LAYOUT, TOTAL, record=_callbacks(SAVE_AT, path))
    results["path"] = str(path)
    results["files"] = sorted(p.name for p in path.iterdir())
    for layout in RESUME_LAYOUTS:
        results[("resume", layout)] = _fit(layout, TOTAL, ckpt_path=path)


def _bf16(results: dict, tmp: Path) -> None:
    path = tmp / "bf16.ckpt"
    results["bf16_straight"] = _fit(LAYOUT, BF16_TOTAL, precision="bf16-mixed", record=_callbacks(BF16_SAVE_AT, path))
    results["bf16_resume"] = _fit(BF16_RESUME, BF16_TOTAL, precision="bf16-mixed", ckpt_path=path)


def _megatron_save(path: Path):
    from lightning.pytorch.callbacks import Callback

    class SaveMegatron(Callback):
        """After the last step, megatron's own dist_checkpointing writes the state (as Megatron-LM would)."""

        saved: dict | None = None

        def on_train_end(self, trainer, pl_module):
            from benchmarks.baselines import megatron_ckpt
            from lightning_dynatrain.compat.megatron_internals import in_process_checkpoint_write_results

            in_process_checkpoint_write_results()  # a synchronous save: no helper process (the files are the same)
            megatron_ckpt.save(trainer.strategy.megatron, str(path))
            self.saved = local_state(trainer.strategy)

    return SaveMegatron()


def _plain_megatron_load(path: Path, layout: str) -> dict:
    """megatron's own load at ``layout`` (benchmarks/baselines/megatron_ckpt.py), then one step on
    the first global batch: what starting from that checkpoint with megatron alone gives."""
    from benchmarks.baselines import megatron_ckpt
    from benchmarks.baselines.state import BenchSetup, build_empty_state
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy
    from lightning_dynatrain.runtime.steps import train_step
    from lightning_dynatrain.vps.layout import ParallelConfig

    module, data = _module(max_steps=TOTAL), _data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    adam = module.configure_optimizers()
    setup = BenchSetup(shape=module.shape, seed=module.seed, optimizer=dict(
        lr=adam.lr, weight_decay=adam.weight_decay, adam_beta1=adam.betas[0], adam_beta2=adam.betas[1],
        adam_eps=adam.eps, clip_grad=adam.clip_grad))
    state, _ = build_empty_state(setup, ParallelConfig.parse(layout), 0)
    megatron_ckpt.load(state, str(path))

    class Holder:  # what local_state reads of a strategy
        recipe, megatron_or_none, layout = module.recipe, state, state.layout

    loaded = local_state(Holder)
    loss = train_step(state, batch, module.recipe, lr=module.lr_at(0), weight_decay=module.weight_decay)
    destroy()
    return dict(loaded=loaded, loss=loss)


def _megatron(results: dict, tmp: Path) -> None:
    import torch.distributed as dist

    path = tmp / "megatron"
    if dist.get_rank() == 0:
        path.mkdir()
    dist.barrier()
    save = _megatron_save(path)
    results["megatron_straight"] = _fit(LAYOUT, MEGATRON_STEPS, extra=[save])
    results["megatron_saved"] = save.saved
    results["megatron_plain"] = _plain_megatron_load(path, MEGATRON_PLAIN)
    for layout in (MEGATRON_PLAIN, MEGATRON_ZERO0):
        results[("megatron_init", layout)] = _fit(layout, 1, init_from_megatron=path)
    results["megatron_path"] = str(path)


def _keeper(results: dict, tmp: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def keeper():
        return ModelCheckpoint(dirpath=tmp / "kept", monitor="train/loss", mode="min", save_top_k=2, save_last=True,
                               every_n_train_steps=1, filename="{step}")

    first, second = keeper(), keeper()
    results["keeper_first"] = _fit(LAYOUT, KEEPER_FIRST, async_save=True, extra=[first])
    results["keeper_files"] = sorted(p.name for p in (tmp / "kept").iterdir())
    results["keeper_best"] = sorted(Path(p).name for p in first.best_k_models)
    results["keeper_last"] = Path(first.last_model_path).name
    results["keeper_then"] = _fit(LAYOUT, KEEPER_THEN, async_save=True, ckpt_path="last", extra=[second])


def _validate(results: dict, path: str) -> None:
    import torch
    from torch.utils.data import DataLoader

    from lightning_dynatrain.strategy import DynaTrainStrategy, GPTLightningModule

    class Evaluated(GPTLightningModule):
        def validation_step(self, batch, batch_idx):
            return None

    module = Evaluated(_module().shape, lr=3e-3, global_batch_size=8, micro_batch_size=1)
    strategy = DynaTrainStrategy("dp4-tp1-pp1")
    loader = DataLoader([torch.zeros(1)], batch_size=1)
    _trainer(strategy, 1).validate(module, dataloaders=loader, ckpt_path=path)
    results["validate"] = local_state(strategy)


def _refused(results: dict, tmp: Path, path: str, megatron_path: str) -> None:
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.strategy import DynaTrainStrategy, GPTLightningModule

    other = GPTLightningModule(GPTShape(**{**SHAPE, "layers": 4, "hidden": 64}), lr=3e-3, global_batch_size=8,
                               micro_batch_size=1)
    empty = tmp / "empty"
    empty.mkdir(exist_ok=True)
    for name, module, ckpt in (("other_model", other, path), ("no_checkpoint", _module(), str(empty)),
                               ("megatron_as_ckpt_path", _module(), megatron_path)):
        trainer = _trainer(DynaTrainStrategy(LAYOUT), TOTAL)
        results[("refused", name)] = (*_error_of(lambda: trainer.fit(module, datamodule=_data(), ckpt_path=ckpt)),
                                      trainer.global_step)


def _world4_job(rank: int, world_size: int, tmp: str) -> dict:
    import torch

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning launches nothing: the harness did
    torch.set_num_threads(1)
    tmp_path, results = Path(tmp), {}
    _straight_and_resumes(results, tmp_path)
    _bf16(results, tmp_path)
    _megatron(results, tmp_path)
    _keeper(results, tmp_path)
    _validate(results, results["path"])
    _refused(results, tmp_path, results["path"], results["megatron_path"])
    return results


def _world2_job(rank: int, world_size: int, path: str) -> dict:
    import torch

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    from lightning.pytorch import Trainer

    from lightning_dynatrain.strategy import DynaTrainStrategy

    record, module = _callbacks(), _module(max_steps=TOTAL)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DynaTrainStrategy("dp2-tp1-pp1"), max_steps=TOTAL,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[record])
    trainer.fit(module, datamodule=_data(), ckpt_path=path)
    return dict(losses=[l for _, l in module.losses], at_start=record.at_start, layouts=record.layouts,
                batches=record.restored_batches, global_step=trainer.global_step)


def run_checkpoint4(tmp: str) -> list[dict]:
    # megatron's checkpoint writer starts processes of its own: the ranks cannot be daemons
    return run_distributed(_world4_job, 4, tmp, timeout_s=600, collective_timeout_s=240, daemon=False)


def run_checkpoint2(path: str) -> list[dict]:
    return run_distributed(_world2_job, 2, path, timeout_s=240, collective_timeout_s=120)
