"""The demo's ``elastic`` key, launched as the README says: ``dynatrain store``, then the same
``torchrun --nproc-per-node 2 examples/train_gpt.py ...`` twice; the second launch joins the
running fit, which goes on at the policy's layout for 4 processes. The job's store ends the fit 8 steps
after the join (``benchmarks/stop_in_store.py``, given as one more callback on the command line)."""

from __future__ import annotations

import csv
import json
import sys

import pytest

from benchmarks.elastic_job import REPO, ElasticJob, torchrun
from benchmarks.stop_in_store import STOP_KEY

pytestmark = pytest.mark.slow

MAX_STEPS = 1000  # a bound only: the store ends the fit 8 steps after the join (the second launch needs ~30 s)
POLICY = "{2: dp2-tp1-pp1, 4: dp2-tp2-pp1}"


def test_a_second_torchrun_of_the_demo_joins_its_elastic_fit(tmp_path):
    out = tmp_path / "run"
    demo = [str(REPO / "examples" / "train_gpt.py"), "fit", "--config", str(REPO / "examples" / "configs" / "demo.yaml"),
            "--schedule", "null", "--elastic", POLICY, "--trainer.devices", "2", "--trainer.max_steps", str(MAX_STEPS),
            "--trainer.strategy.init_args.layout", "dp2-tp1-pp1", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks+=benchmarks.stop_in_store.StopInStore", "--out", str(out)]
    with ElasticJob(tmp_path / "job", max_steps=0, step_seconds=0) as job:
        first = job.start(torchrun(2, *demo))
        job.wait_for(lambda: job.step() >= 3, what="the first world to train")
        second = job.start(torchrun(2, *demo))  # the README's "later: 2 more join"
        job.wait_for(lambda: job.installed_size() == 4, what="the second launch to join (world 4)")
        joined_at = job.step()
        stop = joined_at + 8
        job.client.store.set(STOP_KEY, str(stop))
        codes = [job.wait(first, timeout=600), job.wait(second, timeout=600)]
        log = job.text()
    assert codes == [0, 0], log
    assert "world 2 -> 4" in log and "dp2-tp1-pp1 -> dp2-tp2-pp1" in log, log
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, stop + 1)), rows[-3:]  # one metrics file, every step
    print(f"joined at step {joined_at}; {json.dumps(rows[-1])}", file=sys.stderr)
