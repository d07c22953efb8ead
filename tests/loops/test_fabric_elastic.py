"""Processes join, leave and die in a running Fabric loop (real store process, Fabric, megatron, gloo):
the loop engine drives the same elastic driver as the Trainer, through its own front
(``loop/elastic_front.py``), and ends where the job says.

``benchmarks/elastic_loop.py`` is a Fabric loop over ``DynaTrainFabricStrategy(elastic=ElasticOptions(...))``
with the tiny GPT's layout map (worlds 3 and 4: ``dp3-tp1-pp1``, ``dp2-tp2-pp1``). Four processes of
one launch train at ``dp2-tp2-pp1``; rank 3 kills itself (SIGKILL) once its micro-batches of step 5
ran. The three survivors agree on a world without it through the store, rebuild the whole state of
step 4 from the replicas they hold at ``dp3-tp1-pp1`` and redo step 5. A process started later joins
(world 4 again: it receives the state and the loop's progress), then rank 0 gets SIGTERM and leaves
(its loop ends at ``engine.should_stop``). Before every third step the loop samples a few tokens in a
rollout phase at ``dp<world>-tp1-pp1``; rank 2 of the world of three left kills itself inside one: the
two survivors recover at ``dp2-tp1-pp1``, the phase raises ``RolloutInterrupted`` and they sample
again, then train on to the step the job's store names.

The oracle for the recovery is megatron-core's own description of the state (``tests/megatron_description.py``):
the survivors' whole state right after the recovery equals, bit for bit, the job's own state after
step 4 as the four processes alive then described it. Every process reports the same loss and the
same global batch for each step it ran, and runs each step once; each rollout phase ran once.
"""

from __future__ import annotations

import signal

import pytest

from benchmarks.elastic_job import REPO, ElasticJob
from benchmarks.elastic_loop import KILL_KEY
from benchmarks.stop_in_store import STOP_KEY
from tests.megatron_description import assemble, differences

pytestmark = pytest.mark.slow

LOOP = REPO / "benchmarks" / "elastic_loop.py"
FAULT_STEP = 5
ROLLOUT_EVERY = 3  # a rollout phase before every third step, in every world


def test_a_fabric_loop_recovers_deaths_in_a_step_and_a_rollout_takes_a_joiner_lets_rank0_leave(tmp_path):
    fault = {3: {"DYNATRAIN_STEP_FAULT": f"3:{FAULT_STEP}:forward_backward"}}
    fit_args = ("--stop-in-store", "--describe-at", str(FAULT_STEP - 1), "--describe-recovered", "--rollout-every",
                str(ROLLOUT_EVERY))
    with ElasticJob(tmp_path / "job", max_steps=60, step_seconds=0.05, dead_after=10.0, suspect_after=2.0,
                    fit_args=fit_args, warm=True, script=LOOP) as job:
        first = job.start_launch(4, rank_env=fault)
        job.wait_for(lambda: job.installed_size() == 3, what="the survivors' world")
        joiner = job.start_python()
        job.wait_for(lambda: job.installed_size() == 4, what="a joiner (world 4 again)")
        rank0 = job.signal_member(0, signal.SIGTERM)
        gone = lambda: all(f":{rank0}:" not in m for m in job.installed())  # noqa: E731
        job.wait_for(lambda: gone() and job.installed_size() == 3, what="rank 0 to leave")
        killed_at = ROLLOUT_EVERY * (job.step() // ROLLOUT_EVERY + 2)  # a phase a few steps on, at world 3
        job.client.store.set(KILL_KEY, f"2:{killed_at}")
        job.wait_for(lambda: job.installed_size() == 2, what="the survivors of the death in a rollout")
        stop = max(job.step(), killed_at) + 3
        job.client.store.set(STOP_KEY, str(stop))
        codes = {p.pid: job.wait(p) for p in [*first, joiner]}
        results, log = job.results(), job.text()
        survivors_of_death = [p.pid for p in first[:3]]
        recovered = assemble(job.described("recovered", pids=survivors_of_death))
        before = assemble(job.described(f"described.{FAULT_STEP - 1}"))
    assert first[0].pid == rank0 and codes[rank0] == 0 and codes[first[3].pid] == -signal.SIGKILL, log
    (in_rollout,) = [pid for pid in (first[1].pid, first[2].pid, joiner.pid) if codes[pid] == -signal.SIGKILL]
    assert sorted(codes.values()) == [-signal.SIGKILL, -signal.SIGKILL, 0, 0, 0], log
    # the state the first recovery made is the job's state of step 4, whole, as megatron describes it
    assert recovered and differences(recovered, before) == []
    assert len(results) == 3, log
    left = results[rank0]
    stayed = [r for pid, r in results.items() if pid != rank0]
    assert left["left"] and left["global_step"] < killed_at, left
    assert sorted(r["rank"] for r in stayed) == [0, 1], log
    for r in stayed:  # Fabric's own world size and rank follow the job's
        assert (r["world"], r["layout"], r["global_step"], r["fabric"]) == (2, "dp2-tp1-pp1", stop, [2, r["rank"]]), r
    assert len({r["shard"] for r in stayed}) == 1  # replicas at dp2-tp1-pp1
    # the death in step 5: recovered from the replicas, nothing redone but the step in flight
    for pid in survivors_of_death:
        if pid in results:
            recovery = results[pid]["recoveries"][0]
            assert (recovery["step"], recovery["old_world"], recovery["new_world"], recovery["src"], recovery["dst"],
                    recovery["steps_redone"]) == (FAULT_STEP - 1, 4, 3, "dp2-tp2-pp1", "dp3-tp1-pp1", 0), recovery
    assert f":{first[3].pid}:" in left["recoveries"][0]["failed"][0]
    # the death in a rollout phase: the survivors recovered at its boundary and sampled again, then trained
    for r in stayed:
        recovery = r["recoveries"][-1]
        assert (recovery["step"], recovery["old_world"], recovery["new_world"], recovery["src"], recovery["dst"],
                recovery["steps_redone"]) == (killed_at - 1, 3, 2, "dp3-tp1-pp1", "dp2-tp1-pp1", 0), recovery
        assert f":{in_rollout}:" in recovery["failed"][0]
        assert [step for step, _ in r["interrupted"]] == [killed_at], r["interrupted"]
    # a joiner came in at a step boundary with the loop's progress, and trained every step after it once
    if joiner.pid in results:
        joined = results[joiner.pid]
        assert [c["dst"] for c in joined["changes"]] == ["dp2-tp2-pp1", "dp3-tp1-pp1"], joined["changes"]
        start = joined["losses"][0][0]
        assert FAULT_STEP < start < killed_at, start
    # the job's rank 0 says what happened, also when it is not the first process of its launch
    for line in ("lost; world 4 -> 3, dp2-tp2-pp1 -> dp3-tp1-pp1", "world 3 -> 4 (+1, generation 2), dp3-tp1-pp1 -> "
                 "dp2-tp2-pp1", "left the job at step", "lost; world 3 -> 2, dp3-tp1-pp1 -> dp2-tp1-pp1"):
        assert line in log, (line, log)
    for r in results.values():  # each step once, from the process's first to its last
        steps = [s for s, _ in r["losses"]]
        assert steps == list(range(steps[0], r["global_step"] + 1)), steps
    for key in ("losses", "samples"):  # every process holds the global loss and batch of each step
        by_step: dict[int, set] = {}
        for r in results.values():
            for step, value in r[key]:
                by_step.setdefault(step, set()).add(value)
        assert all(len(values) == 1 for values in by_step.values()), (key, by_step)
        assert sorted(by_step) == list(range(1, stop + 1))
    for r in results.values():  # a phase before every third step it ran (the changes waited for its end)
        steps = [s for s, _ in r["losses"]]
        assert r["rollouts"] == [s for s in steps if s % ROLLOUT_EVERY == 0], r["rollouts"]
