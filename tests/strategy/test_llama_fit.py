"""A llama-style model (GQA, SwiGLU, RoPE, RMSNorm, untied embeddings) trained by
``GPTLightningModule`` under ``DynaTrainStrategy``, with switches inside the fit (4 real processes, gloo).

All cases share the spawned job of ``families_job.py``.
"""

from __future__ import annotations

import pytest

from lightning_dynatrain.megatron.shapes import model_shape
from tests.strategy.families_job import LLAMA_SCHEDULE, LLAMA_START, LLAMA_STEPS, SIZE
from tests.strategy.logical_state import logical_state, switch_differences

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("step", sorted(LLAMA_SCHEDULE))
def test_every_switch_keeps_the_full_logical_state_bit_for_bit(families4, step: int) -> None:
    """dp2-tp2 -> dp1-tp2-pp2-zero1 -> dp4 -> dp2-pp2: every param (separate output layer included)
    and both Adam moments, assembled from all ranks on both sides, Adam's step and the param groups."""
    runs, _ = families4
    shape = model_shape("llama", **SIZE)
    records = [r["llama"]["switched"] for r in runs]
    assert switch_differences(shape, records, step) == []
    names = {t for t, _ in logical_state(shape, records[0]["after"][step]["layout"], [r["after"][step] for r in records])}
    assert "output_layer.weight" in names  # untied: its own tensor


def test_losses_with_switches_track_a_static_run(families4) -> None:
    runs, _ = families4
    layouts = [LLAMA_START, *LLAMA_SCHEDULE.values()]
    for rank, results in enumerate(runs):
        switched, static = results["llama"]["switched"], results["llama"]["static"]
        assert switched["history"] == [(s, a, b) for s, a, b in zip(LLAMA_SCHEDULE, layouts, layouts[1:])]
        assert len(switched["losses"]) == len(static["losses"]) == LLAMA_STEPS
        assert switched["losses"] == pytest.approx(static["losses"], rel=1e-4), rank
        assert switched["losses"][-1] < switched["losses"][0] - 0.5
