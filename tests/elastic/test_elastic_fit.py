"""Processes join and leave a running ``trainer.fit`` (real store process, torchrun, Lightning,
megatron, gloo): the fit goes on at each new world's layout and ends where a static run ends.

The script (``benchmarks/elastic_fit.py``) trains a model whose worlds 2, 3 and 4 all have valid
layouts at a constant global batch of 12: the GPT preset with every change built ahead
(``dp2-tp1-pp1``, ``dp3-tp1-pp1``, ``dp2-tp2-pp1``) and a rollout phase inside every fourth step
(the static run has none: the losses show the phases changed nothing), and ``examples/own_model.py``'s model of the
user's (its description read from megatron, megatron's learning-rate scheduler) with every change
built in its pause (``dp1-tp1-pp2``, ``dp3-tp1-pp1``, ``dp1-tp2-pp2-vpp3``: its worlds of 4 train at
three model chunks of one layer per stage, so changes go into and out of virtual stages).
"""

from __future__ import annotations

import csv
import signal
import subprocess
import sys

import pytest

from benchmarks.elastic_fit import MODELS
from benchmarks.stop_in_store import STOP_KEY
from benchmarks.elastic_job import SCRIPT, ElasticJob, torchrun

pytestmark = pytest.mark.slow

MAX_STEPS = 80
ROLLOUT_EVERY = 4


def _static(out, model: str) -> dict:
    """The static run's loss and learning rate at every step (the same model, data and global batch):
    one process for the GPT preset (its weights are drawn alike at every layout), the first world's
    two for a model of the user's (its weights are megatron's initialisation at the first layout)."""
    script = [str(SCRIPT), str(out), "--max-steps", str(MAX_STEPS), "--static", "--model", model]
    cmd = torchrun(2, *script) if model == "own" else [sys.executable, *script]
    subprocess.run(cmd, check=True, capture_output=True, cwd=SCRIPT.parents[1],
                   env=ElasticJob(out, max_steps=0, step_seconds=0).env)
    results = [__import__("json").loads(p.read_text()) for p in out.glob("*.json")]
    return {"losses": dict(map(tuple, results[0]["losses"])), "lrs": dict(map(tuple, results[0]["lrs"]))}


@pytest.mark.parametrize("model, ahead", [("tiny", True), ("own", False)], ids=["built_ahead", "own_model_on_demand"])
def test_two_join_rank0_leaves_one_joins_and_leaves_again_and_every_survivor_matches_a_static_run(tmp_path, model,
                                                                                                   ahead):
    static = _static(tmp_path / "static", model)
    logs = tmp_path / "logs"
    # built ahead, each process asks for a layout switch while a change is built (refused, nothing moves),
    # and every fourth step samples in a rollout phase at dp<world>-tp1-pp1 (the changes wait for its end)
    fit_args = ("--log-dir", str(logs), "--model", model, "--stop-in-store") + (
        ("--switch-while-building", "--rollout-every", str(ROLLOUT_EVERY)) if ahead else ("--on-demand",))
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.25, fit_args=fit_args, warm=True) as job:
        first = job.start_torchrun(2)
        job.wait_for(lambda: job.step() >= 3, what="the first world to train")
        joiners = [job.start_python(), job.start_python()]
        job.wait_for(lambda: job.installed_size() == 4, what="two joiners (world 4)")
        rank0 = job.signal_member(0, signal.SIGTERM)  # a preemption notice to rank 0
        again = job.start_python()
        gone = lambda: all(f":{rank0}:" not in m for m in job.installed())  # noqa: E731
        job.wait_for(gone, what="rank 0 to leave")
        job.wait_for(lambda: gone() and job.installed_size() == 4, what="one more joiner (world 4 again)")
        assert job.signal_member(3, signal.SIGTERM) == again.pid  # it leaves: back to a world kept from before
        job.wait_for(lambda: job.installed_size() == 3, what="the last joiner to leave (world 3 again)")
        stop = job.step() + 8  # a few steps of the last world, then the fit ends (every rank at that step)
        assert stop < MAX_STEPS, "the last change came too late: raise MAX_STEPS"
        job.client.store.set(STOP_KEY, str(stop))
        codes = [job.wait(p) for p in [first, *joiners, again]]
        results = job.results()
        log = job.text()
    assert codes == [0, 0, 0, 0], log
    # the watchdog, heartbeat and builds ended with the fit (none may run into the interpreter's exit)
    assert {r["pid"]: r["threads_after_fit"] for r in results.values()} == {r["pid"]: [] for r in results.values()}
    left = [r for r in results.values() if r["left"]]
    survivors = [r for r in results.values() if not r["left"]]
    assert sorted(r["pid"] for r in left) == sorted([rank0, again.pid]) and len(survivors) == 3, log
    assert {r["global_step"] for r in survivors} == {stop}
    layouts = MODELS[model]["policy"]
    assert {(r["world"], r["layout"]) for r in survivors} == {(3, layouts[3])}
    assert sorted(r["rank"] for r in survivors) == [0, 1, 2]
    assert len({r["shard"] for r in survivors}) == 1  # the data-parallel replicas are identical
    # every change of the job: 2 -> 4 (the joiners together, or one at a time), 4 -> 3 (rank 0 left),
    # 3 -> 4, 4 -> 3 (the last joiner left), each at the policy's layout, each moving state; every
    # survivor holds all of them, the joiners too (the grow that admitted them came from rank 0)
    history = [[(c["step"], c["change"], c["src"], c["dst"]) for c in r["changes"]] for r in survivors]
    assert all(h == history[0] for h in history), history
    changes = survivors[0]["changes"]
    sizes = [2] + [int(c["change"].split(" -> ")[1].split()[0]) for c in changes]
    assert sizes in ([2, 4, 3, 4, 3], [2, 3, 4, 3, 4, 3]), changes
    # the last change returned to the world of 3 that the one before it left: kept, so no group was built
    assert [c["kept_world"] for c in changes] == [False] * (len(changes) - 1) + [True], changes
    assert [(c["src"], c["dst"]) for c in changes] == [(layouts[a], layouts[b]) for a, b in zip(sizes, sizes[1:])]
    assert all(c["moved_bytes"] > 0 and c["pause_seconds"] > 0 for c in changes)
    assert all(c["overlap_slowdown"] is not None and c["overlap_slowdown"] > -1 for c in changes)
    # built ahead: the target's model, DDP and optimizer were built in the background, the pause bound them
    assert all((c["ahead_build_seconds"] is not None) == ahead for c in changes), changes
    if ahead:  # every process was an old member at some change's prepare boundary, and asked then
        answers = [r["switch_while_building"] for r in results.values()]
        assert len(answers) == 5 and all(a[0] == "WorldChangePendingError" and a[2] for a in answers), answers
        assert all("is built ahead" in a[1] for a in answers), answers
    # one metrics file, continued by each rank 0 in turn (rank 0 left at one change): every step in it
    (metrics,) = logs.glob("metrics/version_*/metrics.csv")
    with open(metrics, newline="") as f:
        logged = {int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")}
    assert logged == set(range(stop)), sorted(set(range(stop)) - logged)
    print("\n".join(f"step {c['step']}: {c['change']} {c['src']} -> {c['dst']}: pause {c['pause_seconds']:.3f} s, "
                    f"transfer {c['transfer_seconds']:.3f} s, built {c['build_seconds']:.3f} s "
                    f"(steps meanwhile {100 * c['overlap_slowdown']:+.0f}%), "
                    f"{c['moved_bytes'] / 2**20:.2f} MiB" for c in changes))
    # the loss of every step, whoever ran it, is the static run's (the same global batches), and so
    # is its learning rate: exactly (a scheduler's state joined each new member with Lightning's)
    seen: dict[int, float] = {}
    for r in results.values():
        for step, loss in r["losses"]:
            assert seen.setdefault(step, loss) == pytest.approx(loss, rel=1e-6), f"ranks disagree at step {step}"
        for step, lr in r["lrs"]:
            assert lr == static["lrs"][step], f"step {step}: lr {lr}, static {static['lrs'][step]}"
    assert sorted(seen) == list(range(1, stop + 1))
    if ahead:  # each process's rollouts: every fourth step it computed, through every change
        for r in results.values():
            assert r["rollouts"] == [s for s, _ in r["losses"] if s % ROLLOUT_EVERY == 0], (r["pid"], r["rollouts"])
    for step, loss in seen.items():
        assert loss == pytest.approx(static["losses"][step], rel=1e-4), f"step {step}"
