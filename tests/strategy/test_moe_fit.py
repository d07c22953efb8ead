"""An MoE model (4 experts, top-2, dropless, shared expert) trained by ``GPTLightningModule`` under
``DynaTrainStrategy``, switching its expert layout inside one fit (4 real processes, gloo).

All cases share the spawned job of ``families_job.py``.
"""

from __future__ import annotations

import pytest

from lightning_dynatrain.megatron.shapes import model_shape
from tests.strategy.families_job import MOE_SCHEDULE, MOE_START, MOE_STEPS, SIZE
from tests.strategy.logical_state import logical_state, switch_differences

pytestmark = pytest.mark.slow


def test_the_fit_switches_expert_layouts_at_the_scheduled_steps(families4) -> None:
    """ep 2 -> 4 (zero1 on), ep 4 -> 2 with dp4 -> dp2-tp2 (etp 1 -> 2), etp 2 -> 1 alone, then pp2;
    every switch ran with ``verify=True`` (the fingerprint of the whole state, or the fit would have raised)."""
    runs, _ = families4
    layouts = [MOE_START, *MOE_SCHEDULE.values()]
    expected = [(step, src, dst) for step, src, dst in zip(MOE_SCHEDULE, layouts, layouts[1:])]
    for results in runs:
        switched = results["moe"]["switched"]
        assert switched["global_step"] == MOE_STEPS and switched["history"] == expected
        starts = {step: layout for step, layout, *_ in switched["seen"]}
        assert [starts[s] for s in (0, *MOE_SCHEDULE)] == layouts  # each step after a switch ran at its target


@pytest.mark.parametrize("step", sorted(MOE_SCHEDULE))
def test_every_expert_layout_switch_keeps_the_full_logical_state_bit_for_bit(families4, step: int) -> None:
    """Every param (router, each expert, shared expert, attention, norms, embeddings) and both Adam
    moments, assembled from all ranks right before and right after the switch, Adam's step and the
    param groups' settings: the same bits."""
    runs, _ = families4
    shape = model_shape("moe", **SIZE)
    records = [r["moe"]["switched"] for r in runs]
    assert switch_differences(shape, records, step) == []
    after = logical_state(shape, records[0]["after"][step]["layout"], [r["after"][step] for r in records])
    experts = {t for t, _ in after if ".experts." in t}
    assert len(experts) >= 2 and any("router" in t for t, _ in after)


def test_losses_track_a_static_run(families4) -> None:
    """fp32, dropless routing: the losses with four expert-layout switches are those of a run that
    stayed at the first layout, to 1e-4 relative."""
    runs, _ = families4
    for rank, results in enumerate(runs):
        switched, static = results["moe"]["switched"], results["moe"]["static"]
        assert len(switched["losses"]) == len(static["losses"]) == MOE_STEPS
        assert switched["losses"] == pytest.approx(static["losses"], rel=1e-4), rank
        assert switched["losses"][-1] < switched["losses"][0] - 0.3
        assert switched["dtypes"] == ["torch.float32"]


def test_the_moe_layer_keeps_no_state_outside_the_optimizer(families4) -> None:
    """Megatron 0.16's router keeps buffers only for expert bias (``expert_bias``, saved, and
    ``local_tokens_per_expert``) and for the global-batch aux loss (``global_tokens_per_expert``,
    ``ga_steps``); the MoE family uses neither (no load-balancing loss, softmax scores), so the
    model has no buffer at any layout of the fit and a switch has nothing besides params and Adam
    state to carry. If a family turned one of those options on, its buffers would show up here."""
    runs, _ = families4
    for results in runs:
        switched = results["moe"]["switched"]
        for side in ("before", "after"):
            for step, state in switched[side].items():
                assert state["buffers"] == [], (side, step, state["layout"])
        router = results["router"]
        assert router["family"] == dict(buffers=[], options=("none", 0.0, False, "softmax"))
        assert router["expert_bias"]["buffers"] == [("expert_bias", (4,), True), ("local_tokens_per_expert", (4,), False)]
        assert router["global_aux_loss"]["buffers"] == [("ga_steps", (), False), ("global_tokens_per_expert", (4,), False)]
