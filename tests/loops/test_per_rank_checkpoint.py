"""The loop engine under a plain ``LoopLibrary`` (the default process group made by the test's
launcher, no loop library), two gloo processes, one job:

- a per-rank checkpoint folder of an earlier version (every rank's model and optimizer shard, and
  ``layout.json``) still loads: written at ``dp1-tp2-pp1`` after one step the way earlier versions
  wrote it, a second engine built at ``dp2`` switches to the folder's layout in memory, then reads
  the shards;
- a model of the user's (``ModelProvider``: the GPT with its own MLP layer) with megatron's
  ``OptimizerConfig`` (SGD with momentum) trains and switches ``dp2 -> tp2 -> dp2`` under the engine
  (``verify=True``: the whole logical state compared around each switch), through the same set-up
  as the strategy (``build_training_state``: its description checked on the live module), and
  tracks an engine that never switched;
- the user's MoE (``ModelProvider``, sigmoid routing, a shared expert) at ``dp2-tp1-pp1-ep2`` enters a
  rollout phase at ``dp1-tp2-pp1`` (the experts from ep2 to ep1, tensor-parallel, the weights freed
  and the optimizer parked on the host), samples and scores there, and leaves: megatron's description
  of the whole state is the same bits before and after, the rollout model held the training weights,
  and the next step's loss is the loss of an engine that never entered the phase.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_distributed

pytestmark = pytest.mark.slow


class PlainLibrary:
    """A ``LoopLibrary`` over a default process group someone else made: CPU, fp32, prints on rank 0."""

    name, settings, device, params_dtype = "plain torch.distributed", None, torch.device("cpu"), torch.float32

    def print(self, text: str) -> None:
        if dist.get_rank() == 0:
            print(text, flush=True)

    def describe(self) -> str:
        return dist.get_backend()

    def node_rank(self) -> int:
        return 0

    def attach(self, engine) -> list:
        return []


def _own_model_engine(layout: str, *, verify: bool):
    from megatron.core.optimizer import OptimizerConfig

    from lightning_dynatrain.accelerate import DynaTrainPlugin
    from lightning_dynatrain.loop import DynaTrainEngine
    from lightning_dynatrain.runtime.recipe import MegatronRecipe
    from tests.strategy.own_models import GLOBAL_BATCH, MICRO_BATCH, split_mlp_gpt

    recipe = MegatronRecipe(model=split_mlp_gpt(), seed=11, global_batch_size=GLOBAL_BATCH,
                            micro_batch_size=MICRO_BATCH)
    return DynaTrainEngine(PlainLibrary(), DynaTrainPlugin(layout=layout, schedule_ahead=False, verify=verify),
                           recipe=recipe, optimizer=OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.9,
                                                                    weight_decay=0.01))


def _own_model(rank: int, world: int) -> dict:
    from lightning_dynatrain.data import StdlibBytes
    from tests.strategy.own_models import SEQ

    runs = {}
    for name, layouts in (("switched", ["dp2-tp1-pp1", "dp1-tp2-pp1", "dp2-tp1-pp1"]), ("static", ["dp2-tp1-pp1"])):
        engine = _own_model_engine(layouts[0], verify=name == "switched")
        batches = iter(engine.dataloader(StdlibBytes(SEQ, max_bytes=40_000), seed=5))
        losses = []
        for step in range(6):
            if step in (2, 4) and len(layouts) > 1:
                engine.reconfigure(layouts[step // 2])
            losses.append(engine.train_step(next(batches)))
        runs[name] = {"losses": losses, "history": [(str(r.src), str(r.dst)) for r in engine.history]}
        engine.close()
    return runs


def _engine(layout: str):
    from lightning_dynatrain.accelerate import DynaTrainPlugin
    from lightning_dynatrain.data import VOCAB_SIZE
    from lightning_dynatrain.loop import DynaTrainEngine
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.runtime.layout_checks import vocab_divisor_for
    from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe

    shape = GPTShape(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=VOCAB_SIZE, seq_length=16,
                     make_vocab_size_divisible_by=vocab_divisor_for(VOCAB_SIZE, [1, 2]))
    recipe = MegatronRecipe(model=shape, seed=7, global_batch_size=4, micro_batch_size=1)
    return DynaTrainEngine(PlainLibrary(), DynaTrainPlugin(layout=layout, schedule_ahead=False), recipe=recipe,
                           adam=AdamSettings(lr=1e-3))


def _params(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.state.model.named_parameters()}


def _moe_rollout(rank: int, world: int) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from lightning_dynatrain.accelerate import DynaTrainPlugin
    from lightning_dynatrain.data import StdlibBytes
    from lightning_dynatrain.loop import DynaTrainEngine
    from lightning_dynatrain.runtime.recipe import MegatronRecipe
    from tests.megatron_description import describe, describe_model
    from tests.strategy.own_models import GLOBAL_BATCH, MICRO_BATCH, SEQ, sigmoid_moe

    out: dict = {}
    for name in ("rolled", "plain"):
        recipe = MegatronRecipe(model=sigmoid_moe(), seed=13, global_batch_size=GLOBAL_BATCH,
                                micro_batch_size=MICRO_BATCH)
        engine = DynaTrainEngine(PlainLibrary(), DynaTrainPlugin(layout="dp2-tp1-pp1-ep2", schedule_ahead=False),
                                 recipe=recipe, optimizer=OptimizerConfig(optimizer="adam", lr=3e-3))
        batches = iter(engine.dataloader(StdlibBytes(SEQ, max_bytes=40_000), seed=5))
        losses = [engine.train_step(next(batches))]
        if name == "rolled":
            out["before"] = describe(engine.state)
            prompts = torch.arange(3 * 5).reshape(3, 5) % 200
            with engine.rollout("dp1-tp2-pp1", park="host", keep_weights=False) as policy:
                out["model"] = describe_model(policy.model)
                generated = policy.generate(prompts, max_new_tokens=3, temperature=1.0, seed=5)
                out["generated"] = (generated.tokens.numpy(), generated.log_probs.numpy())
                out["scored"] = policy.log_probs(generated.tokens).numpy()
            out["after"] = describe(engine.state)
        losses.append(engine.train_step(next(batches)))
        out[name] = losses
        engine.close()
    return out


def _job(rank: int, world: int, folder: str) -> dict:
    return {"per_rank": _per_rank(rank, world, folder), "own_model": _own_model(rank, world),
            "moe_rollout": _moe_rollout(rank, world)}


def _per_rank(rank: int, world: int, folder: str) -> dict:
    from lightning_dynatrain.data import StdlibBytes
    from lightning_dynatrain.loop.checkpoint import SHARDS, load_engine_state
    from lightning_dynatrain.checkpoint.training_checkpoint import save_rank_checkpoint
    from lightning_dynatrain.runtime.steps import optimizer_state_dict

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


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("loop") / "ckpt"
    return folder, run_distributed(_job, 2, str(folder), timeout_s=300)


def test_a_per_rank_folder_of_an_earlier_version_loads_by_switching_to_its_layout(job) -> None:
    folder, results = job
    for result in (r["per_rank"] for r in results):
        assert result["layout"] == "dp1-tp2-pp1"  # switched to the folder's layout, then read the shards
        assert (result["loaded_step"], result["last"]) == (1, str(folder))
        assert result["same_params"]
        straight, resumed = result["next_loss"]
        assert resumed == straight  # the optimizer's state came back too: the next step is bit for bit


def test_a_model_of_the_users_with_sgd_trains_and_switches_under_the_loop_engine(job) -> None:
    _, results = job
    for runs in (r["own_model"] for r in results):
        switched, static = runs["switched"], runs["static"]
        assert switched["history"] == [("dp2-tp1-pp1", "dp1-tp2-pp1"), ("dp1-tp2-pp1", "dp2-tp1-pp1")]
        assert switched["losses"][:2] == static["losses"][:2]  # before the first switch: the same run
        assert switched["losses"] == pytest.approx(static["losses"], rel=1e-4)
        assert switched["losses"][-1] < switched["losses"][0]


def test_a_rollout_of_the_users_moe_under_the_loop_engine_leaves_its_state_as_it_was(job) -> None:
    import numpy as np

    from tests.megatron_description import assemble, differences

    runs = [r["moe_rollout"] for r in job[1]]
    before, after = assemble([r["before"] for r in runs]), assemble([r["after"] for r in runs])
    assert any(k.startswith("optimizer.") or k.startswith("chained_") for k in before)  # moments too
    assert differences(before, after) == []
    params = {k: v for k, v in before.items() if not k.startswith(("optimizer.", "chained_"))}
    assert any(".experts." in k for k in params) and differences(params, assemble([r["model"] for r in runs])) == []
    tokens, log_probs = runs[0]["generated"]
    assert tokens.shape == (3, 8) and tokens[:, :5].tolist() == (np.arange(15).reshape(3, 5) % 200).tolist()
    assert all(np.array_equal(r["generated"][0], tokens) and np.array_equal(r["scored"], runs[0]["scored"])
               for r in runs)
    assert np.abs(runs[0]["scored"][:, 4:] - log_probs).max() <= 1e-5  # what generate reports is what scoring gives
    assert all(r["rolled"] == r["plain"] for r in runs), [(r["rolled"], r["plain"]) for r in runs]
