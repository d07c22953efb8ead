"""``examples/own_model.py``, as a user runs it: Lightning's own launcher starts 4 CPU processes, the
user's GPT (its own MLP submodule) trains under megatron's scheduler and switches twice."""

from __future__ import annotations

import sys

import pytest

from tests.loops.jobs import run_job

pytestmark = pytest.mark.slow


def test_the_example_trains_a_users_model_through_two_switches(tmp_path) -> None:
    proc = run_job([sys.executable, "examples/own_model.py", "--max-steps", "8", "--schedule",
                    "3:dp1-tp2-pp2,6:dp4-tp1-pp1-zero1"], tmp_path)
    out = proc.stdout + proc.stderr
    assert "step 3: dp2-tp2-pp1 -> dp1-tp2-pp2" in out and "step 6: dp1-tp2-pp2 -> dp4-tp1-pp1-zero1" in out
    line = next(l for l in proc.stdout.splitlines() if l.startswith("own-gpt:"))
    assert "8 steps" in line and "2 switches, ending at dp4-tp1-pp1-zero1" in line
    first, last = (float(x) for x in line.split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first
