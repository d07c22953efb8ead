"""A wrong axis in a model's derived description: the library's own mapping cannot see it, megatron's can.

The "bit for bit" checks of switches of a user's model (``tests/strategy/test_own_models.py``) and of
recoveries (``tests/elastic/test_recovery_fit.py``) read the whole state through megatron-core's own
description (``tests/megatron_description.py``), not through the library's mapping. This test shows
why: two processes train a GPT whose Virtual Parameter Space is derived from megatron's description
(``gpt_provider``) at ``dp1-tp2-pp1``, then switch to ``dp2-tp1-pp1``; once as derived, once with one
axis of the derived spec wrong on purpose (attention's output projection said to be split on its
rows instead of its columns: the same number of elements on each rank, so nothing fails and the
switch scrambles that weight). The state before and after is read both ways:

- through the library's mapping (``tests/logical_state.assemble`` with the spec the switch used):
  equal before and after in both runs, so the old check passes the scrambled switch;
- through megatron's description: equal in the honest run, different in the corrupted one, naming
  the scrambled weight.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.dist import run_distributed
from tests.megatron_description import assemble, differences

pytestmark = pytest.mark.slow

SHAPE = dict(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=16, make_vocab_size_divisible_by=128)
WRONG = "decoder.layers.self_attention.linear_proj.weight"


def _with_a_wrong_axis(spec):
    """``spec`` with ``WRONG``'s tensor-parallel axis moved from its columns to its rows (a square
    weight: every local tensor keeps its number of elements)."""
    from dataclasses import replace

    tensor = spec.tensor(WRONG)
    assert tensor.axes == ("layer", "", "tp") and tensor.shape[1] == tensor.shape[2], tensor
    wrong = replace(tensor, axes=("layer", "tp", ""))
    return replace(spec, tensors=tuple(wrong if t.name == WRONG else t for t in spec.tensors))


def _library_view(run) -> dict:
    """This rank's local tensors as the library keys them (the old check's input), as integer bits."""
    import torch

    from lightning_dynatrain.megatron.state_bridge import megatron_store

    state, rank = run.state, torch.distributed.get_rank()
    store = megatron_store(state.ddp, state.optimizer, run.recipe.model.spec(), state.layout, rank)
    return {key: t.detach().clone().reshape(-1).view(torch.int32).numpy() for key, t in store.items()}


def _switch(rank: int, corrupt: bool) -> dict:
    import torch

    from lightning_dynatrain.megatron.gpt import GPTShape, gpt_provider
    from lightning_dynatrain.megatron.provider import ModelProvider
    from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe
    from lightning_dynatrain.runtime.settings import DynaTrainSettings
    from lightning_dynatrain.runtime.training_run import TrainingRun
    from tests.megatron_description import describe

    derived_spec = ModelProvider.spec
    if corrupt:  # only in this process, for this run
        ModelProvider.spec = lambda self: _with_a_wrong_axis(derived_spec(self))
    try:
        recipe = MegatronRecipe(model=gpt_provider(GPTShape(**SHAPE)), seed=3, global_batch_size=4, micro_batch_size=1,
                                params_dtype=torch.float32)
        run = TrainingRun(DynaTrainSettings(layout="dp1-tp2-pp1", promote_broadcasts=False))
        run.start(run.settings.layout, world_size=2, node_rank=0)
        run.build_model(recipe, rank=rank)
        run.set_optimizer(AdamSettings(lr=1e-2))
        run.install(run.build_state())
        tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
        run.train_step({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, lr=1e-2, weight_decay=0.0)
        out = {"spec": run.recipe.model.spec(), "before": (describe(run.state), _library_view(run))}
        run.switch(run.check("dp2-tp1-pp1"), step=1)
        out["after"] = (describe(run.state), _library_view(run))
        run.close()
        return out
    finally:
        ModelProvider.spec = derived_spec


def _job(rank: int, world_size: int) -> dict:
    return {"honest": _switch(rank, corrupt=False), "corrupted": _switch(rank, corrupt=True)}


def _old_check(runs: list[dict]) -> list[str]:
    """The library-mapped comparison: the state assembled with the spec the switch used, before and after."""
    from lightning_dynatrain.vps.layout import ParallelConfig
    from lightning_dynatrain.vps.spec import Precision
    from tests.logical_state import assemble as assemble_mapped
    from tests.logical_state import common

    spec = runs[0]["spec"]
    before = assemble_mapped(spec, ParallelConfig.parse("dp1-tp2-pp1"), [r["before"][1] for r in runs], Precision.FP32)
    after = assemble_mapped(spec, ParallelConfig.parse("dp2-tp1-pp1"), [r["after"][1] for r in runs], Precision.FP32)
    return [f"{key}" for key in before if not np.array_equal(*common(before[key], after[key]))]


def _new_check(runs: list[dict]) -> list[str]:
    return differences(assemble([r["before"][0] for r in runs]), assemble([r["after"][0] for r in runs]))


@pytest.fixture(scope="module")
def switched() -> list[dict]:
    return run_distributed(_job, 2, timeout_s=300)


def test_an_honest_switch_passes_both_checks(switched) -> None:
    runs = [r["honest"] for r in switched]
    assert _old_check(runs) == [] and _new_check(runs) == []


def test_a_wrong_derived_axis_passes_the_library_mapped_check_and_fails_megatrons(switched) -> None:
    runs = [r["corrupted"] for r in switched]
    assert runs[0]["spec"].tensor(WRONG).axes == ("layer", "tp", "")  # the switch ran with the wrong axis
    assert _old_check(runs) == []  # the mapping reads its own mistake back: nothing seems to change
    found = _new_check(runs)
    assert found and all(WRONG in line for line in found), found  # the weight and its Adam state, named
    print("the library-mapped check: no difference; megatron's description:", found)
