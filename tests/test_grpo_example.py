"""``examples/grpo_arithmetic.py``, short (40 iterations, 4 processes under Lightning's own launcher):
each iteration enters a rollout at ``dp4-tp1-pp1``, samples, leaves, and takes a GRPO step at
``dp1-tp2-pp2-zero1`` through megatron's pipeline schedule. The reward it prints and writes rises
(the run is seeded: the same on every run), leaving moves nothing back (the training shards were
kept), and the reward picture is written.
"""

from __future__ import annotations

import csv

import pytest

from tests.loops.jobs import run_job

pytestmark = pytest.mark.slow

ITERATIONS = 40


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import sys

    out = tmp_path_factory.mktemp("grpo")
    proc = run_job([sys.executable, "examples/grpo_arithmetic.py", "--iterations", str(ITERATIONS), "--out",
                    str(out)], out)
    with open(out / "metrics.csv", newline="") as f:
        rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
    return dict(out=out, rows=rows, stdout=proc.stdout)


def test_every_iteration_is_a_rollout_and_a_policy_step(run):
    rows = run["rows"]
    assert [int(r["iteration"]) for r in rows] == list(range(1, ITERATIONS + 1))
    for r in rows:
        assert r["rollout_start"] < r["rollout_end"] < r["train_end"]
        assert 0 <= r["reward"] <= 1 and r["loss"] == r["loss"]  # not NaN
        assert r["enter_sent_bytes"] > 0 and r["leave_sent_bytes"] == 0  # keep_weights: nothing moves back


def test_the_reward_rises(run):
    rewards = [r["reward"] for r in run["rows"]]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"mean reward of the first 10 iterations {first:.3f}, of the last 10 {last:.3f}")
    assert last >= first + 0.08, (first, last)
    assert f"{ITERATIONS} iterations, mean reward" in run["stdout"]


def test_the_reward_picture_is_written(run):
    assert (run["out"] / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
