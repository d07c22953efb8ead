"""A per-rank checkpoint folder of an earlier version (every rank's model and optimizer shard, and
``layout.json``) still loads into a ``DynaTrainEngine``: the engine switches to the folder's layout
in memory, then reads the shards.

Two gloo processes run the engine under a plain ``LoopHost`` (the default process group made by
the test's launcher, no loop library): the folder is written at ``dp1-tp2-pp1`` after one step the
way earlier versions wrote it, then a second engine built at ``dp2`` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_distributed

pytestmark = pytest.mark.slow


class PlainHost:
    """A ``LoopHost`` over a default process group someone else made: CPU, fp32, prints on rank 0."""

    name, plugin, device, params_dtype = "plain torch.distributed", None, torch.device("cpu"), torch.float32

    def print(self, text: str) -> None:
        if dist.get_rank() == 0:
            print(text, flush=True)

    def describe(self) -> str:
        return dist.get_backend()

    def cluster_environment(self):
        from lightning.fabric.plugins.environments import LightningEnvironment

        return LightningEnvironment()

    def attach(self, engine) -> list:
        return []


def _engine(layout: str):
    from lightning_dynatrain.accelerate import DynaTrainPlugin
    from lightning_dynatrain.data import VOCAB_SIZE
    from lightning_dynatrain.loop import DynaTrainEngine
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.strategy import AdamSettings, MegatronRecipe, vocab_divisor_for

    shape = GPTShape(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=VOCAB_SIZE, seq_length=16,
                     make_vocab_size_divisible_by=vocab_divisor_for(VOCAB_SIZE, [1, 2]))
    recipe = MegatronRecipe(model=shape, seed=7, global_batch_size=4, micro_batch_size=1)
    return DynaTrainEngine(PlainHost(), DynaTrainPlugin(layout=layout, schedule_ahead=False), recipe=recipe,
                           adam=AdamSettings(lr=1e-3))


def _params(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.state.model.named_parameters()}


def _job(rank: int, world: int, folder: str) -> dict:
    from lightning_dynatrain.data import StdlibBytes
    from lightning_dynatrain.loop.checkpoint import SHARDS, load_engine_state
    from lightning_dynatrain.strategy.checkpoint import save_rank_checkpoint
    from lightning_dynatrain.strategy.megatron_step import optimizer_state_dict

    first = _engine("dp1-tp2-pp1")
    batches = iter(first.dataloader(StdlibBytes(16, max_bytes=20_000), seed=3))
    first.train_step(next(batches))
    shards = Path(folder) / SHARDS
    state = first.state  # the files earlier versions wrote, per rank
    save_rank_checkpoint({"model": state.model.state_dict(), "optimizer": optimizer_state_dict(state)}, shards,
                         rank=rank, layout=state.layout, world_size=world)
    if rank == 0:
        (shards / "layout.json").write_text(json.dumps({"layout": "dp1-tp2-pp1", "world_size": world, "step": 1}))
    dist.barrier()
    saved, batch = _params(first), next(batches)
    next_loss = first.train_step(batch)
    first.close()

    second = _engine("dp2-tp1-pp1")
    load_engine_state(second, folder)
    loaded = _params(second)
    return {"layout": str(second.layout), "loaded_step": second.loaded_step, "last": second.last_checkpoint,
            "same_params": sorted(loaded) == sorted(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved),
            "next_loss": (next_loss, second.train_step(batch))}


def test_a_per_rank_folder_of_an_earlier_version_loads_by_switching_to_its_layout(tmp_path: Path) -> None:
    results = run_distributed(_job, 2, str(tmp_path / "ckpt"), timeout_s=180)
    for result in results:
        assert result["layout"] == "dp1-tp2-pp1"  # switched to the folder's layout, then read the shards
        assert (result["loaded_step"], result["last"]) == (1, str(tmp_path / "ckpt"))
        assert result["same_params"]
        straight, resumed = result["next_loss"]
        assert resumed == straight  # the optimizer's state came back too: the next step is bit for bit
