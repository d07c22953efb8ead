"""Layout-free checkpoints under a real Trainer: saved at one layout, resumed at others and at another
world size, bit for bit; megatron checkpoints as a start; ``ModelCheckpoint`` and background saves.

All cases share two spawned jobs (``checkpoint_job.py``): 4 processes, then 2 for the world-2 resume.
"""

from __future__ import annotations

import numpy as np
import pytest

from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import Precision, StateKind
from tests.logical_state import assemble, common
from tests.strategy.checkpoint_job import (
    BF16_RESUME,
    BF16_SAVE_AT,
    BF16_TOTAL,
    KEEPER_FIRST,
    KEEPER_THEN,
    LAYOUT,
    MEGATRON_PLAIN,
    MEGATRON_STEPS,
    MEGATRON_ZERO0,
    RESUME_LAYOUTS,
    SAVE_AT,
    TOTAL,
)
from tests.strategy.jobs import SHAPE

pytestmark = pytest.mark.slow
SPEC = logical_spec(GPTShape(**SHAPE))


def logical(records: list[dict], precision: Precision = Precision.FP32, kinds=None) -> dict:
    """The full logical state from every rank's ``checkpoint_job.local_state`` record."""
    return assemble(SPEC, ParallelConfig.parse(records[0]["layout"]), [r["tensors"] for r in records], precision,
                    kinds)


def differences(a: dict, b: dict, kinds: set[str] | None = None) -> list[str]:
    keys = {k for k in a if kinds is None or k[1].value in kinds}
    out = [f"{k} is missing" for k in keys ^ {k for k in b if kinds is None or k[1].value in kinds}]
    return out + [f"{k} differs" for k in sorted(keys & set(b), key=str) if not np.array_equal(*common(a[k], b[k]))]


def scalars(record: dict) -> tuple:
    return record["step"], sorted(record["groups"], key=lambda g: (g["wd_mult"], g["lr_mult"]))


def test_a_checkpoint_is_one_dcp_directory(checkpoint4: list[dict]) -> None:
    assert checkpoint4[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]


@pytest.mark.parametrize("layout", RESUME_LAYOUTS)
def test_resuming_at_any_layout_restores_the_full_state_bit_for_bit(checkpoint4: list[dict], layout: str) -> None:
    """Params, Adam moments, step and param-group settings after the load equal those saved at
    dp2-tp2-pp1-zero1 after step 3; so do the loops and callbacks (3 steps, 3 batches counted, the
    schedule entry at step 2 done: the run stays at its layout)."""
    saved = [r["straight"]["saved"] for r in checkpoint4]
    loaded = [r[("resume", layout)]["at_start"] for r in checkpoint4]
    assert differences(logical(saved), logical(loaded)) == []
    for s, l in zip(saved, loaded):
        assert scalars(s) == scalars(l) and s["step"] == SAVE_AT
    for results in checkpoint4:
        run = results[("resume", layout)]
        assert run["batches"] == SAVE_AT and run["global_step"] == TOTAL
        assert run["layouts"] == [layout] * (TOTAL - SAVE_AT)


@pytest.mark.parametrize("layout", RESUME_LAYOUTS)
def test_the_next_losses_are_the_uninterrupted_runs(checkpoint4: list[dict], layout: str) -> None:
    """Exactly where the layout is the one saved at; within 1e-4 where it differs."""
    straight = checkpoint4[0]["straight"]["losses"][SAVE_AT:]
    for results in checkpoint4:
        losses = results[("resume", layout)]["losses"]
        assert len(losses) == TOTAL - SAVE_AT == 5
        if layout == LAYOUT:
            assert losses == straight
        else:
            assert losses == pytest.approx(straight, rel=1e-4)


def test_a_world4_checkpoint_resumes_on_2_processes(checkpoint4: list[dict], checkpoint_world2: list[dict]) -> None:
    saved = [r["straight"]["saved"] for r in checkpoint4]
    loaded = [r["at_start"] for r in checkpoint_world2]
    assert loaded[0]["layout"] == "dp2-tp1-pp1"
    assert differences(logical(saved), logical(loaded)) == []
    assert all(scalars(l) == scalars(saved[0]) for l in loaded)
    for run in checkpoint_world2:
        assert run["batches"] == SAVE_AT and run["global_step"] == TOTAL
        assert run["losses"] == pytest.approx(checkpoint4[0]["straight"]["losses"][SAVE_AT:], rel=1e-4)


def test_a_bf16_checkpoint_resumes_at_another_layout(checkpoint4: list[dict]) -> None:
    """bf16 params, the fp32 params megatron keeps (norms), fp32 main params and moments, bit for bit;
    the first loss after the load (a function of the params alone) exactly, the next within 1e-4."""
    saved = [r["bf16_straight"]["saved"] for r in checkpoint4]
    loaded = [r["bf16_resume"]["at_start"] for r in checkpoint4]
    assert loaded[0]["layout"] == BF16_RESUME
    before, after = logical(saved, Precision.BF16), logical(loaded, Precision.BF16)
    assert {k[1].value for k in before} == {"param", "main_param", "exp_avg", "exp_avg_sq"}
    assert differences(before, after) == []
    assert scalars(saved[0]) == scalars(loaded[0]) and saved[0]["step"] == BF16_SAVE_AT
    straight = checkpoint4[0]["bf16_straight"]["losses"][BF16_SAVE_AT:]
    resumed = checkpoint4[0]["bf16_resume"]["losses"]
    assert len(resumed) == BF16_TOTAL - BF16_SAVE_AT and resumed[0] == straight[0]
    assert resumed == pytest.approx(straight, rel=1e-4)


def test_a_megatron_checkpoint_starts_a_run_like_a_plain_megatron_load(checkpoint4: list[dict]) -> None:
    """megatron dist_checkpointing wrote the state (distributed optimizer, fully_reshardable) at
    dp2-tp2-pp1-zero1. ``init_from_megatron`` at dp1-tp2-pp2-zero1 holds the state megatron's own
    load holds there, bit for bit, and its first loss is the same float; at dp2-tp1-pp2 (zero0,
    which megatron 0.16.1 cannot load this checkpoint into) the state is the same too."""
    saved = logical([r["megatron_saved"] for r in checkpoint4])
    plain = logical([r["megatron_plain"]["loaded"] for r in checkpoint4])
    assert differences(saved, plain) == []  # megatron's own round trip, the reference
    for layout in (MEGATRON_PLAIN, MEGATRON_ZERO0):
        started = [r[("megatron_init", layout)]["at_start"] for r in checkpoint4]
        assert started[0]["layout"] == layout
        assert differences(plain, logical(started)) == [], layout
        assert all(scalars(s) == scalars(checkpoint4[0]["megatron_plain"]["loaded"]) for s in started)
        assert started[0]["step"] == MEGATRON_STEPS
    for results in checkpoint4:
        first = results[("megatron_init", MEGATRON_PLAIN)]["losses"][0]
        assert first == results["megatron_plain"]["loss"]
        assert results[("megatron_init", MEGATRON_ZERO0)]["losses"][0] == pytest.approx(first, rel=1e-4)
        assert results[("megatron_init", MEGATRON_PLAIN)]["batches"] == 0  # Lightning's counters start at 0


def test_model_checkpoint_keeps_top_k_and_last_and_resumes_from_last(checkpoint4: list[dict]) -> None:
    """Top 2 by loss and ``last.ckpt`` (directories), written in the background; the older ones
    removed; ``fit(ckpt_path="last")`` goes on from step 4 exactly as the uninterrupted run."""
    results = checkpoint4[0]
    assert results["keeper_files"] == ["last.ckpt", f"step={KEEPER_FIRST - 1}.ckpt", f"step={KEEPER_FIRST}.ckpt"]
    assert results["keeper_best"] == [f"step={KEEPER_FIRST - 1}.ckpt", f"step={KEEPER_FIRST}.ckpt"]
    assert results["keeper_last"] == "last.ckpt"
    straight = results["straight"]["losses"]
    for results in checkpoint4:
        assert results["keeper_first"]["losses"] == straight[:KEEPER_FIRST]
        then = results["keeper_then"]
        assert then["batches"] == KEEPER_FIRST and then["global_step"] == KEEPER_THEN
        assert then["losses"] == straight[KEEPER_FIRST:KEEPER_THEN]


def test_validate_with_a_checkpoint_loads_the_params_without_an_optimizer(checkpoint4: list[dict]) -> None:
    saved = logical([r["straight"]["saved"] for r in checkpoint4])
    validated = [r["validate"] for r in checkpoint4]
    assert validated[0]["layout"] == "dp4-tp1-pp1" and validated[0]["step"] is None
    params = logical(validated, kinds={StateKind.PARAM})
    assert {k[1].value for k in params} == {"param"}
    assert differences(saved, params, kinds={"param"}) == []


@pytest.mark.parametrize("case, kind, words", [
    ("other_model", "CheckpointMismatchError", ["holds another model", "num_layers=2 (run: 4)", "hidden=32 (run: 64)"]),
    ("no_checkpoint", "CheckpointError", ["is not a DynaTrainStrategy checkpoint", ".metadata"]),
    ("megatron_as_ckpt_path", "CheckpointError", ["megatron dist_checkpointing wrote it", "init_from_megatron=PATH"]),
])
def test_bad_checkpoints_are_refused_before_anything_is_loaded(checkpoint4: list[dict], case: str, kind: str,
                                                               words: list[str]) -> None:
    for results in checkpoint4:
        got, text, global_step = results[("refused", case)]
        assert got == kind and "HINT" in text and global_step == 0, text
        for word in words:
            assert word in text
