"""Layout-free DCP checkpoints of synthetic state on 2 real processes (``jobs.py``): resharding at
load, vocabulary padding that differs by tp, the background writer and replacing a checkpoint."""

from __future__ import annotations

import pytest

from tests.checkpoint.jobs import GATE_SECONDS, PAIRS

pytestmark = pytest.mark.slow


def test_a_checkpoint_loads_bit_for_bit_at_another_layout(checkpoint2: list[dict]) -> None:
    """tp, pp, dp, ep, etp and zero1 change, dense and MoE, fp32 and bf16; tp1 pads the vocabulary to
    192 rows, tp2 to 256:
    rows only the checkpoint has are dropped, rows only the new layout has are zeroed (the job
    compares every element's bits with what the new layout holds)."""
    for results in checkpoint2:
        assert results["reshard"]["pairs"] == [tuple(p) for p in PAIRS]


def test_a_background_save_does_not_hold_the_step_and_the_next_save_waits_for_it(checkpoint2: list[dict]) -> None:
    for results in checkpoint2:
        run = results["async"]
        # save returned while its write was held (the gate opens only after it returned)
        assert not run["first_complete_after_save"] and run["pending"].endswith("first.ckpt")
        assert run["second_waited_s"] >= GATE_SECONDS * 0.9, run
        assert run["first_complete_when_second_starts"] and run["second_complete_after_close"]
        assert run["left_behind"] == ["first.ckpt", "second.ckpt"]  # no staging directory left


def test_saving_over_a_checkpoint_or_a_link_replaces_it(checkpoint2: list[dict]) -> None:
    for results in checkpoint2:
        run = results["overwrite"]
        assert run["link_replaced"] and run["target_kept"] and run["files"] == ["last.ckpt", "step=1.ckpt"]
