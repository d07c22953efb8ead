"""One check of a switch request for every front end: the Trainer and the loop engine refuse alike.

Under SGD, ZeRO-1 (megatron's distributed optimizer, Adam only) is refused at the switch, before
anything moves. Two processes train the same tiny GPT under ``DynaTrainStrategy`` and under the loop
engine (a plain ``LoopLibrary`` over the test's process group); each is asked for ``dp2-tp1-pp1-zero1``
directly (``reconfigure``) and by its schedule (``ScheduledReconfig``, ``SwitchSchedule`` of the
engine's settings). Both raise the same typed error with the same message, marked refused, record
the same refusal, and go on training at ``dp2-tp1-pp1``.
"""

from __future__ import annotations

import pytest

from tests.dist import run_distributed

pytestmark = pytest.mark.slow

SHAPE = dict(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=16, make_vocab_size_divisible_by=128)
TARGET = "dp2-tp1-pp1-zero1"


class _PlainLibrary:
    """A ``LoopLibrary`` over the default process group the test made: CPU, fp32, prints on rank 0."""

    def __init__(self) -> None:
        import torch

        self.name, self.settings, self.device, self.params_dtype = "plain", None, torch.device("cpu"), torch.float32

    def print(self, text: str) -> None:
        pass

    def describe(self) -> str:
        return "gloo"

    def node_rank(self) -> int:
        return 0

    def attach(self, engine) -> list:
        return []


def _sgd():
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.9)


def _refusal(call) -> tuple[str, str, bool]:
    from lightning_dynatrain.transition.errors import was_refused

    try:
        call()
    except Exception as err:  # noqa: BLE001 - what the front end raised is the result
        return type(err).__name__, str(err), was_refused(err)
    return "nothing", "", False


def _under_the_trainer(rank: int) -> dict:
    import os

    from lightning.pytorch import Callback, Trainer

    from lightning_dynatrain import DynaTrainStrategy, MegatronLightningModule, ScheduledReconfig
    from lightning_dynatrain.data import StdlibTextDataModule
    from lightning_dynatrain.megatron.gpt import GPTShape

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning launches nothing: the harness did
    found: dict = {}

    class AskDirectly(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                found["direct"] = _refusal(lambda: trainer.strategy.reconfigure(TARGET))
                found["layout_after"] = str(trainer.strategy.layout)

    schedule = ScheduledReconfig({1: TARGET})
    module = MegatronLightningModule(GPTShape(**SHAPE), global_batch_size=4, micro_batch_size=1, optimizer=_sgd())
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DynaTrainStrategy("dp2-tp1-pp1"), max_steps=3,
                      callbacks=[schedule, AskDirectly()], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=StdlibTextDataModule(seq_length=16, global_batch_size=4, seed=0, max_bytes=50_000))
    return {**found, "scheduled": schedule.refusals, "steps": trainer.global_step}


def _under_the_loop_engine() -> dict:
    import torch

    from lightning_dynatrain.loop import DynaTrainEngine
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.runtime.recipe import MegatronRecipe
    from lightning_dynatrain.runtime.settings import DynaTrainSettings

    recipe = MegatronRecipe(model=GPTShape(**SHAPE), seed=1234, global_batch_size=4, micro_batch_size=1)
    engine = DynaTrainEngine(_PlainLibrary(), DynaTrainSettings(layout="dp2-tp1-pp1", schedule={1: TARGET}),
                             recipe=recipe, optimizer=_sgd())
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    for _ in range(2):
        engine.train_step(batch)
    found = {"direct": _refusal(lambda: engine.reconfigure(TARGET)), "layout_after": str(engine.layout)}
    engine.train_step(batch)
    found.update(scheduled=list(engine.refusals), steps=engine.step)
    engine.close()
    return found


def _job(rank: int, world_size: int) -> dict:
    return {"trainer": _under_the_trainer(rank), "engine": _under_the_loop_engine()}


def test_zero1_under_sgd_is_refused_alike_by_the_trainer_and_the_loop_engine() -> None:
    results = run_distributed(_job, 2, timeout_s=300)
    for result in results:
        trainer, engine = result["trainer"], result["engine"]
        kind, message, refused = trainer["direct"]
        assert (kind, refused) == ("LayoutError", True), trainer["direct"]
        assert "zero1" in message and "sgd" in message.lower() and "HINT" in message, message
        assert engine["direct"] == trainer["direct"]  # the same type, message and refusal mark
        assert trainer["scheduled"] == engine["scheduled"] == [(1, TARGET, kind, message)]
        assert trainer["layout_after"] == engine["layout_after"] == "dp2-tp1-pp1"
        assert trainer["steps"] == engine["steps"] == 3  # training went on at the old layout
