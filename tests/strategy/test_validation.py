"""Validation under the strategy as in any Lightning strategy (4 processes, real Trainer, gloo, megatron).

One job runs, in order:

1. ``fit``: 4 steps starting at dp2-tp2-pp1 with a switch after step 1 (to dp1-tp2-pp2) and after step
   3 (to dp4), validation every 2 steps (so at dp1-tp2-pp2 and at dp4) and a sanity check at the
   start; the module also logs each rank's data-parallel rank with ``sync_dist=True``;
   ``ModelCheckpoint(monitor="val_loss")`` keeps the best;
2. ``plain``: the same fit with validation turned off (``limit_val_batches=0``): the training
   losses must be the same floats;
3. ``validate``: ``trainer.validate(ckpt_path=...)`` of the checkpoint written at step 4's validation,
   at dp2-tp2-pp1 and at dp1-tp2-pp2 (no optimizer is built): the validation loss of the same state
   at other layouts, pipeline stages included.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist import run_distributed
from tests.strategy.jobs import GLOBAL_BATCH, SHAPE, _module, _trainer

pytestmark = pytest.mark.slow

SCHEDULE = {1: "dp1-tp2-pp2", 3: "dp4-tp1-pp1"}
STEPS, VAL_EVERY = 4, 2


def _data():
    from lightning_dynatrain.data import StdlibTextDataModule

    return StdlibTextDataModule(seq_length=SHAPE["seq_length"], global_batch_size=GLOBAL_BATCH, shuffle=True,
                                seed=0, max_bytes=300_000, val_samples=2 * GLOBAL_BATCH)


def _recorder():
    from lightning.pytorch.callbacks import Callback

    class Record(Callback):
        """Each validation's layout, step, logged metrics (this rank's), and the training losses."""

        def __init__(self):
            self.validations: list[tuple[str, int, float, float]] = []

        def on_validation_end(self, trainer, pl_module):
            m = trainer.callback_metrics
            self.validations.append((str(trainer.strategy.layout), trainer.global_step, float(m["val_loss"]),
                                     float(m["dp_rank_mean"])))

    return Record()


def _module_logging_dp_rank(**kwargs):
    """``GPTLightningModule`` that also logs its data-parallel rank with ``sync_dist=True``: the mean
    over the data-parallel group is (dp - 1) / 2 only if the strategy reduced it."""
    module = _module(**kwargs)
    validation_step = module.validation_step

    def step(batch, batch_idx):
        validation_step(batch, batch_idx)
        strategy = module.trainer.strategy
        dp = strategy.megatron.dp_rank if strategy.megatron_or_none is not None else strategy.groups.dp.rank()
        module.log("dp_rank_mean", float(dp), on_step=False, on_epoch=True, sync_dist=True, batch_size=1)

    module.validation_step = step
    return module


def _job(rank: int, world_size: int, tmp: str) -> dict:
    import os

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_dynatrain.callbacks import ScheduledReconfig
    from lightning_dynatrain.strategy import DynaTrainStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning launches nothing: the harness did
    out: dict = {}
    record = _recorder()
    keeper = ModelCheckpoint(dirpath=Path(tmp, "ckpt"), monitor="val_loss", mode="min", save_top_k=1,
                             filename="step{step}")
    module = _module_logging_dp_rank(max_steps=STEPS)
    trainer = _trainer(DynaTrainStrategy("dp2-tp2-pp1"), STEPS, callbacks=[ScheduledReconfig(SCHEDULE), record, keeper],
                       enable_checkpointing=True, val_check_interval=VAL_EVERY, check_val_every_n_epoch=None,
                       num_sanity_val_steps=1)
    trainer.fit(module, datamodule=_data())
    out["fit"] = dict(validations=record.validations, losses=module.losses, best=str(keeper.best_model_path),
                      best_score=float(keeper.best_model_score))

    plain = _module(max_steps=STEPS)
    _trainer(DynaTrainStrategy("dp2-tp2-pp1"), STEPS, callbacks=[ScheduledReconfig(SCHEDULE)],
             limit_val_batches=0).fit(plain, datamodule=_data())
    out["plain_losses"] = plain.losses

    for layout in ("dp2-tp2-pp1", "dp1-tp2-pp2"):
        record = _recorder()
        validator = _trainer(DynaTrainStrategy(layout), STEPS, callbacks=[record])
        validator.validate(_module_logging_dp_rank(max_steps=STEPS), datamodule=_data(),
                           ckpt_path=out["fit"]["best"])
        out[("validate", layout)] = record.validations
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_job, 4, str(tmp_path_factory.mktemp("validation")), timeout_s=420, collective_timeout_s=180)


def test_validation_runs_at_each_layout_and_logs_the_same_reduced_values_on_every_rank(results):
    for r in results:
        layouts = [(layout, step) for layout, step, _, _ in r["fit"]["validations"]]
        assert layouts == [("dp2-tp2-pp1", 0), ("dp1-tp2-pp2", 2), ("dp4-tp1-pp1", 4)]
        # sync_dist reduced over the current data-parallel group: mean of its ranks
        assert [v[3] for v in r["fit"]["validations"]] == [0.5, 0.0, 1.5]
    assert len({tuple(v[2] for v in r["fit"]["validations"]) for r in results}) == 1, "val_loss differs by rank"
    assert all(v[2] > 0 for v in results[0]["fit"]["validations"])


def test_validation_leaves_training_unchanged(results):
    for r in results:
        assert r["fit"]["losses"] == r["plain_losses"]


def test_validate_from_a_checkpoint_gives_the_same_loss_at_other_layouts(results):
    best_step = min(results[0]["fit"]["validations"][1:], key=lambda v: v[2])
    assert results[0]["fit"]["best_score"] == pytest.approx(best_step[2], rel=1e-6)
    for r in results:
        for layout in ("dp2-tp2-pp1", "dp1-tp2-pp2"):
            ((seen_layout, _, loss, dp_mean),) = r[("validate", layout)]
            assert seen_layout == layout and dp_mean == {"dp2-tp2-pp1": 0.5, "dp1-tp2-pp2": 0.0}[layout]
            assert loss == pytest.approx(best_step[2], rel=1e-5), (layout, loss, best_step)
