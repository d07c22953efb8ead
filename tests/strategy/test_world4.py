"""4 real processes, real Trainer, real megatron: loss parity across layouts, resume, validation, switching plumbing.

All cases share one spawned job (``jobs.run_world4``); see ``jobs.py`` for what each case runs.
"""

from __future__ import annotations

import csv
import io
import math

import pytest

from tests.strategy.jobs import (
    BF16_SCHEDULE,
    BF16_STEPS,
    GLOBAL_BATCH,
    PARITY_LAYOUTS,
    STEPS,
    SWITCH_AT,
    SWITCH_LAYOUTS,
    SWITCH_STEPS,
)

pytestmark = pytest.mark.slow


def test_losses_agree_across_layouts(world4: list[dict]) -> None:
    """dp4, dp2-tp2, dp1-tp2-pp2 and dp2-pp2-zero1 train the same model on the same global batches."""
    reference = world4[0][("parity", PARITY_LAYOUTS[0])]["losses"]
    assert len(reference) == STEPS and all(math.isfinite(x) for x in reference)
    assert reference[-1] < reference[0] - 0.1, "the loss falls over 5 steps"
    for rank, results in enumerate(world4):
        for layout in PARITY_LAYOUTS:
            run = results[("parity", layout)]
            assert run["global_step"] == STEPS and run["env"] == "LightningEnvironment"
            assert run["losses"] == pytest.approx(reference, rel=1e-4), (rank, layout)


def test_data_parallel_share_follows_the_layout(world4: list[dict]) -> None:
    """Every rank gets the whole global batch; micro-batches = G // (dp * micro); sampler kwargs = dp coords."""
    expected_dp = {"dp4-tp1-pp1": 4, "dp2-tp2-pp1": 2, "dp1-tp2-pp2": 1, "dp2-tp1-pp2-zero1": 2}
    for rank, results in enumerate(world4):
        for layout, dp in expected_dp.items():
            for step, (seen_step, seen_layout, dp_size, micro, sampler, shape) in enumerate(
                    results[("parity", layout)]["seen"]):
                assert (seen_step, seen_layout, dp_size, micro) == (step, layout, dp, GLOBAL_BATCH // dp)
                assert shape == (GLOBAL_BATCH, 32)
                assert sampler["num_replicas"] == dp and 0 <= sampler["rank"] < dp
    # dp rank of global rank r: dp4 -> r; dp2-tp2 -> r // 2; dp2-pp2 -> r % 2 (tp-cp-ep-dp-pp order)
    assert [w[("parity", "dp4-tp1-pp1")]["seen"][0][4]["rank"] for w in world4] == [0, 1, 2, 3]
    assert [w[("parity", "dp2-tp2-pp1")]["seen"][0][4]["rank"] for w in world4] == [0, 0, 1, 1]
    assert [w[("parity", "dp2-tp1-pp2-zero1")]["seen"][0][4]["rank"] for w in world4] == [0, 1, 0, 1]


def test_resume_from_a_per_rank_checkpoint(world4: list[dict]) -> None:
    """A per-rank checkpoint of an earlier version (``checkpoint.legacy``) still resumes at the layout
    that wrote it: 3 steps + checkpoint + resume to 5 == 5 straight steps (zero1 optimizer shards,
    pipeline stages); at another layout it is refused, naming where it loads."""
    straight = world4[0][("parity", PARITY_LAYOUTS[-1])]["losses"]
    for results in world4:
        resume = results["resume"]
        assert resume["files"] == ["rank00000.pt", "rank00001.pt", "rank00002.pt", "rank00003.pt"]
        assert resume["losses"] == pytest.approx(straight, rel=1e-6)
        kind, text = resume["wrong_layout"]
        assert kind == "LayoutError" and "written at layout dp2-tp1-pp2-zero1" in text and "HINT" in text
        assert "DynaTrainStrategy(layout='dp2-tp1-pp2-zero1')" in text


@pytest.mark.parametrize("case, words", [
    ("far", ["step 5000", "dp1-tp1-pp4", "pp=4 must divide the 2 layers", "HINT"]),
    ("world", ["step 10", "needs dp*tp*pp*cp = 2 processes but the job runs 4", "Elastic Device Manager"]),
    ("batch", ["step 7", "global batch 8 is not a multiple of dp * micro_batch_size = 4 * 4"]),
])
def test_schedule_refused_at_setup(world4: list[dict], case: str, words: list[str]) -> None:
    """A bad entry anywhere in the schedule stops fit before the first step (and before the model is built)."""
    for results in world4:
        kind, text, global_step, model_missing = results[("refused", case)]
        assert kind == "ScheduleError" and global_step == 0 and model_missing
        for word in words:
            assert word in text


def test_a_switch_over_the_memory_limit_is_refused_before_anything_moves(world4: list[dict]) -> None:
    for results in world4:
        run = results["memory_refusal"]
        assert run["kind"] == "SwitchMemoryError", run
        assert "dp2-tp2-pp1 -> dp4-tp1-pp1" in run["text"] and "switch_memory_limit" in run["text"]
        assert "nothing was moved" in run["text"] and "HINT" in run["text"]
        assert run["global_step"] == 2 and run["layout"] == "dp2-tp2-pp1" and run["history"] == 0
        assert len(run["losses"]) == 2
    assert world4[0]["memory_refusal"]["losses"] == world4[0][("parity", "dp2-tp2-pp1")]["losses"][:2]


def test_a_refused_scheduled_switch_is_a_warning_and_training_goes_on(world4: list[dict]) -> None:
    """ScheduledReconfig's default (on_refused="continue"): the refusal is logged and recorded (and
    kept in the callback's state), and the fit reaches max_steps at the old layout."""
    for rank, results in enumerate(world4):
        run = results["memory_refusal_continue"]
        assert run["kind"] == "" and run["global_step"] == STEPS and run["layout"] == "dp2-tp2-pp1"
        (step, layout, kind, text), = run["refusals"]
        assert (step, layout, kind) == (2, "dp4-tp1-pp1", "SwitchMemoryError") and "switch_memory_limit" in text
        assert run["state"]["refusals"] == [[step, layout, kind, text]]
        assert bool(run["warned"]) == (rank == 0)  # rank-zero warning
        assert run["losses"] == world4[0][("parity", "dp2-tp2-pp1")]["losses"]


def test_mid_step_request_is_deferred_and_switches_are_logged(world4: list[dict]) -> None:
    """reconfigure() inside step 2 returns None and runs when the step returns; schedule entries fire at
    the step boundary (a repeated entry is a no-op); every switch's real figures reach the logger."""
    expected_layout = {}
    for i, start in enumerate(SWITCH_AT):
        for step in range(start, SWITCH_AT[i + 1] if i + 1 < len(SWITCH_AT) else SWITCH_STEPS):
            expected_layout[step] = SWITCH_LAYOUTS[i]
    for rank, results in enumerate(world4):
        run = results["switching"]
        assert run["answers"] == [None, SWITCH_LAYOUTS[1]]
        assert [(s, layout) for s, layout, *_ in run["seen"]] == sorted(expected_layout.items())
        history = run["history"]
        assert [(h["step"], h["src"], h["dst"], h["deferred"]) for h in history] == [
            (SWITCH_AT[i + 1], SWITCH_LAYOUTS[i], SWITCH_LAYOUTS[i + 1], i == 0) for i in range(3)]
        # dp4 -> dp2-tp2 and dp2-tp2 -> dp1-tp2-pp2-zero1 only drop what each rank no longer needs
        # (Megatron's rank order keeps every rank's new slice local); -> dp2-tp1-pp2 widens tp: moves
        assert [h["moved_bytes"] > 0 for h in history] == [False, False, True]
        for h in history:
            assert h["seconds"] > 0 and h["retained_bytes"] > 0
            assert (h["peak_staging_bytes"] > 0) == (h["moved_bytes"] > 0), h
            assert h["peak_staging_bytes"] <= 64 * 1024, h  # the strategy's staging_budget
            assert {"rebuild", "transfer"} <= set(h["phase_seconds"])
        # ScheduledReconfig builds its entries ahead, in the background (the mid-step request is
        # built on demand, and drops the build made for the first entry from the old layout)
        assert [h["ahead_build_seconds"] is not None for h in history] == [False, True, True]
        assert all(h["ahead_build_seconds"] > 0 for h in history[1:])
        assert run["noop"]["src"] == run["noop"]["dst"] == SWITCH_LAYOUTS[-1] and run["noop"]["seconds"] == 0
    rows = list(csv.DictReader(io.StringIO(world4[0]["switching"]["metrics"])))
    switch_rows = [r for r in rows if r.get("dynatrain/switch_seconds")]
    assert [int(r["step"]) for r in switch_rows] == SWITCH_AT[1:]
    for r in switch_rows:
        assert float(r["dynatrain/switch_seconds"]) > 0 and float(r["dynatrain/retained_bytes"]) > 0
    assert [bool(r.get("dynatrain/switch_ahead_build_seconds")) for r in switch_rows] == [False, True, True]


def test_losses_with_switches_track_the_static_run(world4: list[dict]) -> None:
    """30 steps through dp4 -> dp2-tp2 -> dp1-tp2-pp2-zero1 -> dp2-pp2: every loss within 1e-4 of the
    run that stayed at dp4 (the switches carried the state bit for bit: ``verify=True`` checked it)."""
    for rank, results in enumerate(world4):
        run = results["switching"]
        assert len(run["losses"]) == len(run["static"]) == SWITCH_STEPS
        assert run["losses"] == pytest.approx(run["static"], rel=1e-4), rank
        assert run["losses"][-1] < run["losses"][0] - 0.5


def test_step_count_and_learning_rate_survive_switches(world4: list[dict]) -> None:
    """Adam's step count equals the global step at every step start, switches included, and the
    learning rate is the schedule's value for that step on every layout."""
    for results in world4:
        scalars = results["switching"]["scalars"]
        assert [g for g, _, _ in scalars] == list(range(SWITCH_STEPS))
        assert [s for _, s, _ in scalars] == list(range(1, SWITCH_STEPS + 1))
        assert [lrs for _, _, lrs in scalars] == [lrs for _, _, lrs in results["switching"]["static_scalars"]]


def test_a_bf16_mixed_fit_switches_and_tracks_the_static_run(world4: list[dict]) -> None:
    """Trainer(precision="bf16-mixed") builds megatron's bf16 params with fp32 main params (no
    autocast plugin); switches across dp/tp/pp and zero1 on and off keep the full logical state
    (``verify=True`` fingerprints bf16 params, fp32 norms, main params and moments around each),
    and the losses stay within 1e-2 of a static bf16 run."""
    for rank, results in enumerate(world4):
        switched, static = results["bf16"]["switched"], results["bf16"]["static"]
        assert switched["plugin"] == "MegatronPrecision('bf16-mixed')"
        assert switched["dtypes"] == ["torch.bfloat16", "torch.float32"]  # norms stay fp32, as megatron builds them
        assert [(step, dst) for step, _, dst in switched["history"]] == sorted(BF16_SCHEDULE.items())
        assert len(switched["losses"]) == len(static["losses"]) == BF16_STEPS
        assert switched["losses"] == pytest.approx(static["losses"], rel=1e-2), rank
        assert switched["losses"][-1] < switched["losses"][0]
