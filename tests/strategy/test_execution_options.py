"""Sequence parallelism and activation recompute as recipe options, kept through switches in a fit
(4 real processes, gloo; the llama-style fits of the shared ``families_job.py``)."""

from __future__ import annotations

import pytest

from lightning_dynatrain.megatron.shapes import model_shape
from tests.strategy.families_job import EXEC_SCHEDULE, LLAMA_START, LLAMA_STEPS, SIZE
from tests.strategy.logical_state import switch_differences

pytestmark = pytest.mark.slow


def _config_by_layout(record: dict) -> dict[str, set]:
    seen: dict[str, set] = {}
    for _, layout, sequence_parallel, granularity in record["config"]:
        seen.setdefault(layout, set()).add((sequence_parallel, granularity))
    return seen


def test_options_hold_at_every_layout_and_sequence_parallelism_follows_tp(families4) -> None:
    runs, _ = families4
    for results in runs:
        full, selective = results["execution"]["full"], results["execution"]["selective"]
        assert full["history"] == [(s, a, b) for s, a, b in
                                   zip(EXEC_SCHEDULE, [LLAMA_START, *EXEC_SCHEDULE.values()], EXEC_SCHEDULE.values())]
        assert _config_by_layout(full) == {LLAMA_START: {(True, "full")}, "dp1-tp2-pp2-zero1": {(True, "full")},
                                           "dp4-tp1-pp1": {(False, "full")}, "dp2-tp2-pp1-zero1": {(True, "full")}}
        assert _config_by_layout(selective) == {LLAMA_START: {(False, "selective")}}
        assert len(full["config"]) == len(selective["config"]) == LLAMA_STEPS


@pytest.mark.parametrize("step", sorted(EXEC_SCHEDULE))
def test_switches_with_sequence_parallel_and_recompute_keep_the_state_bit_for_bit(families4, step: int) -> None:
    runs, _ = families4
    records = [r["execution"]["full"] for r in runs]
    assert switch_differences(model_shape("llama", **SIZE), records, step) == []


def test_losses_track_the_run_without_the_options(families4) -> None:
    """Recompute repeats the same arithmetic; sequence parallelism only reorders the sums of the norms'
    gradients: both fits track the static llama run of the same data and start."""
    runs, _ = families4
    for rank, results in enumerate(runs):
        static = results["llama"]["static"]["losses"]
        for name in ("full", "selective"):
            assert results["execution"][name]["losses"] == pytest.approx(static, rel=1e-4), (rank, name)
