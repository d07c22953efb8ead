"""A member killed mid-step (SIGKILL, no goodbye) costs seconds, not the job: the survivors go on.

Four processes of one launch (each its own child, as ``srun`` starts them) train the tiny GPT at
``dp2-tp2-pp1`` under ``OnNodeChange`` with a real store process. One of them kills itself inside
step ``FAULT_STEP`` (``DYNATRAIN_STEP_FAULT``): rank 3 once its micro-batches ran, before the
gradients are reduced (nobody has stepped: the step is redone at the new layout), or rank 0 once
megatron's optimizer step returned (every survivor stepped too: the step counts as done, once).
The three survivors agree on the world without it through the store, rebuild the whole state from
the data-parallel replicas they hold at ``dp3-tp1-pp1`` and train to the end.

The oracle is a static fit of the same model and data at the starting layout (no failure), and
megatron-core's own description of the state (``tests/megatron_description.py``, none of the
library's mapping): the survivors' whole state right after the recovery (before they compute
anything on it) equals, bit for bit, the static fit's at the step the recovery says it holds, for
recoveries from replicas, from a snapshot, and from a snapshot refilled by the ranks that kept the
dead's boxes. Every loss up to the failure is the static fit's bit for bit, every later one within
1e-4 (another layout's float rounding); each step is counted once; the recovery's figures are logged.

At ``dp2-tp2-pp1-zero1`` the dead rank's optimizer shard had no other holder: every survivor ends
with ``MemberFailedError`` naming what was lost and where to resume from, never a mix of steps;
with in-memory snapshots (``OnNodeChange(snapshot_every=3)``) the survivors go back to the snapshot
instead, at ``dp2-tp2-pp1-zero1`` and at ``dp4-tp1-pp1-zero1``, and compute the lost steps again,
also when another member dies after the recovery moved the state (in the keepers' fill, in the
steps computed again). A lost host (SIGSTOP) is named after ``dead_after``; a killed process at
once, with its torchrun launch. A member killed inside a rollout phase (a fit that samples in one
every step) is recovered from as at the step boundary, and the step runs again: from the replicas
where the phase kept the training weights, from the snapshot where it had freed them.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from benchmarks.elastic_job import ElasticJob
from tests.megatron_description import assemble, differences

pytestmark = pytest.mark.slow

MAX_STEPS, FAULT_STEP, SNAPSHOT_FAULT_STEP = 12, 6, 8
#: the step from which the rollout test's phases free the training shards of the weights (and a second member dies)
FREES_FROM = 9


def _static(path: Path, fit_args: tuple[str, ...], described: tuple[int, ...]) -> dict:
    """A fit on four processes that never fail: rank 0's result, and the whole state after each step
    of ``described`` as megatron describes it (``states``)."""
    with ElasticJob(path, max_steps=MAX_STEPS, step_seconds=0.0,
                    fit_args=("--static", "--describe-at", ",".join(map(str, described)), *fit_args), warm=True) as job:
        procs = job.start_launch(4)
        codes = [job.wait(p) for p in procs]
        assert codes == [0, 0, 0, 0], job.tail()
        results = job.results()
        states = {step: assemble(job.described(f"described.{step}")) for step in described}
    losses = {tuple(map(tuple, r["losses"])) for r in results.values()}
    assert len(losses) == 1  # every rank reports the global loss
    return {**next(iter(results.values())), "states": states}


@pytest.fixture(scope="module")
def static_run(tmp_path_factory) -> dict:
    """The same fit at dp2-tp2-pp1 that never fails (the state described after steps 5 and 6)."""
    return _static(tmp_path_factory.mktemp("static"), (), (FAULT_STEP - 1, FAULT_STEP))


@pytest.fixture(scope="module")
def static_zero1(tmp_path_factory) -> dict:
    """The same at dp2-tp2-pp1-zero1 (described after the snapshots' steps: 3, 6, 9)."""
    return _static(tmp_path_factory.mktemp("static_zero1"), ("--zero1", "--start", "dp2-tp2-pp1-zero1"), (3, 6, 9))


@pytest.fixture(scope="module")
def static_dp4(tmp_path_factory) -> dict:
    """The same at dp4-tp1-pp1-zero1 (described after step 6)."""
    return _static(tmp_path_factory.mktemp("static_dp4"), ("--zero1", "--start", "dp4-tp1-pp1-zero1"), (6,))


def _recovered_as_static(job: ElasticJob, static: dict, step: int) -> None:
    """The survivors' whole state right after the recovery, as megatron describes it, is the static
    fit's after ``step`` (the step the recovery's state is of), bit for bit."""
    recovered = assemble(job.described("recovered"))
    assert recovered, "no survivor described the state the recovery made"
    assert differences(recovered, static["states"][step]) == []


@pytest.fixture(scope="module")
def static_losses(static_run) -> dict[int, float]:
    return dict(map(tuple, static_run["losses"]))


def _same_samples(results: dict, static_run: dict) -> None:
    """Each step of the loop trained on the global batch the static fit's step did: no sample lost
    or read twice by the loop (the steps a recovery computed again used the batches it logged)."""
    for r in results.values():
        assert [tuple(x) for x in r["samples"]] == [tuple(x) for x in static_run["samples"]]


@pytest.mark.parametrize(("victim", "phase", "from_step"), [(3, "forward_backward", FAULT_STEP - 1),
                                                          (0, "optimizer", FAULT_STEP)])
def test_the_survivors_of_a_member_killed_mid_step_go_on_and_lose_nothing(tmp_path, static_run, static_losses, victim,
                                                                          phase, from_step):
    """Rank 3 killed once its micro-batches ran (ranks 0 and 1, the other tensor-parallel pair,
    still compute: each of their layers takes 0.5 s in that step, a bigger model's compute), or rank
    0 once megatron's optimizer step returned. Ranks 0 and 1 leave their forward at the next layer
    once their watchdog read the store's record (``noticed_by == "store"``), not at the step's
    gradient all-reduce with the dead."""
    fault = {victim: {"DYNATRAIN_STEP_FAULT": f"{victim}:{FAULT_STEP}:{phase}"}}
    computing = phase == "forward_backward"
    slow = ("--slow-layers", f"0,1:{FAULT_STEP}:0.5") if computing else ()
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.0, dead_after=10.0,
                    suspect_after=2.0, fit_args=("--describe-recovered", *slow), warm=True) as job:
        procs = job.start_launch(4, rank_env=fault)
        codes = [job.wait(p) for p in procs]
        results, log = job.results(), job.text()
        _recovered_as_static(job, static_run, from_step)  # the replicas' state of that step, whole
    assert codes[victim] == -signal.SIGKILL, log
    assert [c for r, c in enumerate(codes) if r != victim] == [0, 0, 0], log
    assert len(results) == 3, log
    for r in results.values():
        assert (r["world"], r["layout"], r["global_step"]) == (3, "dp3-tp1-pp1", MAX_STEPS), r
    recoveries = [r["recoveries"] for r in results.values()]
    assert all(len(rs) == 1 for rs in recoveries), recoveries
    # every survivor: the same world, layouts, the same state's step, the killed process named, nothing lost
    agreed = {(rs[0]["step"], len(rs[0]["failed"]), rs[0]["old_world"], rs[0]["new_world"], rs[0]["src"],
               rs[0]["dst"], rs[0]["steps_redone"]) for rs in recoveries}
    assert agreed == {(from_step, 1, 4, 3, "dp2-tp2-pp1", "dp3-tp1-pp1", 0)}, agreed
    assert f":{procs[victim].pid}:" in recoveries[0][0]["failed"][0], (procs[victim].pid, recoveries[0][0]["failed"])
    if computing:  # the ranks still computing stopped at a layer of the step in flight
        assert {r["rank"]: r["recoveries"][0]["noticed_by"] for r in results.values() if r["rank"] < 2} == \
            {0: "store", 1: "store"}, log
    recovery = recoveries[0][0]
    print(f"killed rank {victim} in {phase}: recovered in {recovery['pause_seconds']:.2f} s (agreement "
          f"{recovery['agree_seconds']:.2f} s, world {recovery['world_seconds']:.2f} s, transfer "
          f"{recovery['transfer_seconds']:.3f} s)")
    assert "lost; world 4 -> 3, dp2-tp2-pp1 -> dp3-tp1-pp1" in log
    # named as its liveness connection closed, not after a silence
    assert "failed: its process ended (its liveness connection closed)" in log, log
    _same_samples(results, static_run)
    for r in results.values():
        steps = [step for step, _ in r["losses"]]
        assert steps == list(range(1, MAX_STEPS + 1)), steps  # each step once, none skipped
        for step, loss in r["losses"]:
            if step <= from_step:  # at dp2-tp2, as the static fit
                assert loss == static_losses[step], (step, loss, static_losses[step])
            else:  # at dp3-tp1-pp1, from the same state
                assert loss == pytest.approx(static_losses[step], rel=1e-4), step


#: (state's step, snapshot step, steps redone, members named, old and new world) of each case: killed entering
#: the recovery switch's transfer, the survivors had freed sources that switch drops first (the snapshot);
#: killed as the survivors' world is built, nothing had moved (their replicas of step 8)
EXPECTED_RECOVERY = {"switch": (SNAPSHOT_FAULT_STEP, 6, 2, 2, 4, 2), "world": (SNAPSHOT_FAULT_STEP, None, 0, 2, 4, 2)}


@pytest.mark.parametrize("where", ["switch", "world"])
def test_a_member_dying_in_the_recovery_is_left_behind_too(tmp_path, static_run, static_losses, where):
    """``dp2-tp2-pp1`` with snapshots every 3 steps: rank 3 is killed after its optimizer step of step
    8; rank 2 kills itself during the recovery: entering the transfer of the recovery's switch (its
    first switch), or as it starts building the survivors' world, where the others wait for it (they
    tell the store, which names it in ``suspect_after``). Ranks 0 and 1 (a whole replica between
    them) agree on a world without it too and train on at ``dp2-tp1-pp1``: one recovery, both named,
    the same samples and losses. Where the failed recovery switch had freed state, they go back to the
    snapshot of step 6 and compute steps 7 and 8 again; else the state of step 8 comes from their
    replicas."""
    dies = {"DYNATRAIN_SWITCH_FAULT": "2:transfer:KILL:1"} if where == "switch" else \
        {"DYNATRAIN_RECOVERY_FAULT": "KILL_IN_WORLD"}
    fault = {3: {"DYNATRAIN_STEP_FAULT": f"3:{SNAPSHOT_FAULT_STEP}:optimizer"}, 2: dies}
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.0, dead_after=10.0, suspect_after=2.0,
                    fit_args=("--snapshot-every", "3"), warm=True) as job:
        procs = job.start_launch(4, rank_env=fault)
        codes = [job.wait(p, timeout=240) for p in procs]
        results, log = job.results(), job.text()
    assert codes == [0, 0, -signal.SIGKILL, -signal.SIGKILL], log
    end = "dp2-tp1-pp1"
    assert {(r["world"], r["layout"], r["global_step"]) for r in results.values()} == {(2, end, MAX_STEPS)}, log
    assert len({r["shard"] for r in results.values()}) == 1
    recoveries = {(x["step"], x["snapshot_step"], x["steps_redone"], len(x["failed"]), x["old_world"], x["new_world"])
                  for r in results.values() for x in r["recoveries"]}
    assert recoveries == {EXPECTED_RECOVERY[where]}, log
    assert all(len(r["recoveries"]) == 1 for r in results.values()), log
    assert "a member died during the recovery" in log, log
    _same_samples(results, static_run)
    for r in results.values():
        assert [step for step, _ in r["losses"]] == list(range(1, MAX_STEPS + 1))
        for step, loss in r["losses"]:
            assert loss == pytest.approx(static_losses[step], rel=1e-4), step


def test_a_zero1_shard_only_the_dead_held_ends_the_job_naming_what_was_lost(tmp_path):
    fault = {1: {"DYNATRAIN_STEP_FAULT": f"1:{FAULT_STEP}:forward_backward"}}
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.0, dead_after=10.0, suspect_after=2.0,
                    fit_args=("--zero1",), warm=True) as job:
        procs = job.start_launch(4, rank_env=fault)
        codes = [job.wait(p, timeout=120) for p in procs]
        log = job.text()
    assert codes[1] == -signal.SIGKILL and all(c not in (0, -signal.SIGKILL) for r, c in enumerate(codes) if r != 1), \
        (codes, log)
    assert "died holding state no survivor has" in log and "exp_avg" in log, log
    assert "of the dp2-tp2-pp1-zero1 state at step 5 are held by no survivor (dead: rank 1)" in log, log
    assert "restart the job from its last checkpoint (this fit wrote none" in log, log


@pytest.mark.parametrize("where", ["KILL_IN_FILL", "KILL_IN_REPLAY"], ids=["fill", "replay"])
def test_state_only_the_dead_held_comes_back_from_the_snapshot_also_when_another_dies_in_the_recovery(
        tmp_path, static_run, static_losses, static_dp4, where):
    """``OnNodeChange(snapshot_every=3)`` at ``dp4-tp1-pp1-zero1``: each rank holds the only copy of
    its ZeRO-1 shard, and the snapshot keeps each rank's copy on the next one (0 -> 1 -> 2 -> 3 ->
    0). Rank 3 is killed in step ``SNAPSHOT_FAULT_STEP`` (8) before its optimizer step (the
    survivors' state is step 7): the three survivors go back to the snapshot of step 6 at the new
    layout, and rank 1 dies as the keepers' fill starts (rank 3's shard from rank 0), or as step 7
    runs again (the fill done): the state has moved to the new layout, the snapshot has not. Ranks
    0 and 2 go back to the same snapshot again, without rank 1 too (its shard kept by rank 2): one
    recovery naming both, the state it made (refilled from the keepers) the static fit's after step
    6 bit for bit, step 7 computed again, each step counted once, the losses those of the static fit.
    (Two deaths lose the state when both held a box nobody copied: at ``dp2-tp2`` a tp shard's two
    replicas, at ``tp2-pp2`` the embedding tied over the first and last stage; the message names
    it: ``test_a_zero1_shard_only_the_dead_held_ends_the_job_naming_what_was_lost``.)"""
    start = "dp4-tp1-pp1-zero1"
    fault = {3: {"DYNATRAIN_STEP_FAULT": f"3:{SNAPSHOT_FAULT_STEP}:forward_backward"},
             1: {"DYNATRAIN_RECOVERY_FAULT": where}}
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.0, dead_after=10.0, suspect_after=2.0,
                    fit_args=("--zero1", "--start", start, "--snapshot-every", "3", "--describe-recovered"),
                    warm=True) as job:
        procs = job.start_launch(4, rank_env=fault)
        codes = [job.wait(p, timeout=240) for p in procs]
        results, log = job.results(), job.text()
        _recovered_as_static(job, static_dp4, 6)  # the snapshot of step 6, the dead's boxes from their keepers
    assert codes == [0, -signal.SIGKILL, 0, -signal.SIGKILL], log
    assert "a member died during the recovery" in log, log
    assert {(r["world"], r["global_step"]) for r in results.values()} == {(2, MAX_STEPS)}, log
    recoveries = [(x["step"], x["snapshot_step"], x["steps_redone"], len(x["failed"]), x["src"], x["old_world"],
                   x["new_world"]) for r in results.values() for x in r["recoveries"]]
    assert set(recoveries) == {(SNAPSHOT_FAULT_STEP - 1, 6, 1, 2, start, 4, 2)} and len(recoveries) == 2, log
    assert "1 step(s) redone from the in-memory snapshot of step 6" in log, log
    _same_samples(results, static_run)
    for r in results.values():
        assert [step for step, _ in r["losses"]] == list(range(1, MAX_STEPS + 1))  # each step once
        for step, loss in r["losses"]:  # the same samples and schedule, at another layout after the failure
            assert loss == pytest.approx(static_losses[step], rel=1e-4), step


def test_a_member_lost_while_a_snapshot_is_taken_goes_back_to_the_previous_one(tmp_path, static_run, static_losses,
                                                                              static_zero1):
    """``OnNodeChange(snapshot_every=3, snapshot_buffers=2)`` at ``dp2-tp2-pp1-zero1``: rank 1 dies
    as its snapshot thread starts the snapshot of step 6, so no rank holds the snapshot of step 6
    whole (rank 1's ZeRO-1 shard of it was never copied). The previous snapshot, of step 3, is whole
    in every survivor's other buffer: they go back to it and compute steps 4-6 again (at most
    ``snapshot_every + 1``), each step counted once, the losses those of the static fit. The state
    they went back to is the static fit's after step 3, bit for bit."""
    fault = {1: {"DYNATRAIN_SNAPSHOT_FAULT": "1:6:KILL"}}
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.0, dead_after=10.0, suspect_after=2.0,
                    fit_args=("--zero1", "--start", "dp2-tp2-pp1-zero1", "--snapshot-every", "3",
                              "--snapshot-buffers", "2", "--describe-recovered"), warm=True) as job:
        procs = job.start_launch(4, rank_env=fault)
        codes = [job.wait(p, timeout=180) for p in procs]
        results, log = job.results(), job.text()
        _recovered_as_static(job, static_zero1, 3)
    assert codes == [0, -signal.SIGKILL, 0, 0], log
    end = "dp3-tp1-pp1-zero1"
    assert {(r["world"], r["layout"], r["global_step"]) for r in results.values()} == {(3, end, MAX_STEPS)}, log
    recoveries = {(x["step"], x["snapshot_step"], x["steps_redone"]) for r in results.values() for x in r["recoveries"]}
    assert recoveries == {(6, 3, 3)}, log
    _same_samples(results, static_run)
    for r in results.values():
        assert [step for step, _ in r["losses"]] == list(range(1, MAX_STEPS + 1))
        for step, loss in r["losses"]:
            assert loss == pytest.approx(static_losses[step], rel=1e-4), step


@pytest.mark.parametrize(("fault", "fit_args"), [
    ("3:confirm:KILL:1", ("--schedule", f"{SNAPSHOT_FAULT_STEP - 1}:dp1-tp2-pp2")),
    ("3:transfer:KILL:1", ("--leave", "3:5"))], ids=["layout_switch", "shrink"])
def test_a_member_lost_in_a_switch_that_freed_state_comes_back_from_the_snapshot(tmp_path, static_run, static_losses,
                                                                                  static_zero1, fault, fit_args):
    """``switch_safety="fast"`` at ``dp2-tp2-pp1-zero1`` with snapshots every 3 steps. Rank 3 dies
    entering the confirm phase of the scheduled switch to ``dp1-tp2-pp2`` after step 7 (every
    survivor has moved and freed its old state), or it asked to leave after step 5 and dies entering
    the transfer of the shrink it hands its state off by (the survivors are in the world of 3
    already). Either way no survivor holds a whole step: each gives its freed storages their memory
    back, writes its snapshot copy in, and the survivors go on at ``dp3-tp1-pp1-zero1`` from the
    snapshot (the static fit's state of its step, bit for bit), computing the steps since again."""
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.0, dead_after=10.0, suspect_after=2.0,
                    fit_args=("--zero1", "--start", "dp2-tp2-pp1-zero1", "--snapshot-every", "3",
                              "--describe-recovered", *fit_args), warm=True) as job:
        procs = job.start_launch(4, rank_env={3: {"DYNATRAIN_SWITCH_FAULT": fault}})
        codes = [job.wait(p, timeout=180) for p in procs]
        results, log = job.results(), job.text()
        recovered = job.described("recovered")
    assert codes == [0, 0, 0, -signal.SIGKILL], log
    end = "dp3-tp1-pp1-zero1"
    assert {(r["world"], r["layout"], r["global_step"]) for r in results.values()} == {(3, end, MAX_STEPS)}, log
    recoveries = {(x["step"], x["snapshot_step"], x["steps_redone"], x["src"], x["dst"], x["old_world"], x["new_world"])
                  for r in results.values() for x in r["recoveries"]}
    assert len(recoveries) == 1 and all(len(r["recoveries"]) == 1 for r in results.values()), log
    step, snapshot_step, redone, src, dst, old_world, new_world = recoveries.pop()
    assert (src, dst, old_world, new_world) == ("dp2-tp2-pp1-zero1", end, 4, 3), log
    assert snapshot_step % 3 == 0 and redone == step - snapshot_step and 0 < redone <= 3, log
    if "--schedule" in fit_args:
        assert (step, snapshot_step) == (SNAPSHOT_FAULT_STEP - 1, 6), log
    assert differences(assemble(recovered), static_zero1["states"][snapshot_step]) == []
    assert f"{redone} step(s) redone from the in-memory snapshot of step {snapshot_step}" in log, log
    _same_samples(results, static_run)
    for r in results.values():
        assert [s for s, _ in r["losses"]] == list(range(1, MAX_STEPS + 1))  # each step once
        for s, loss in r["losses"]:
            assert loss == pytest.approx(static_losses[s], rel=1e-4), s


def test_a_lost_host_is_named_after_dead_after_and_a_spare_grows_the_world_back(tmp_path):
    """Every process of the second launch (node 1) stopped at once (SIGSTOP: a host that vanished or
    hangs; its connections stay open, nothing fails, no liveness connection closes): the store names
    both, in one record, once they were silent ``dead_after`` (by its own count, within a pass or two
    after it), the survivors' watchdogs abandon the collectives they wait in, and they go on at world
    2. Continued, the stopped processes find themselves out of the job and end with that message. A
    spare started then joins as any joiner does, and the world is 3."""
    from benchmarks.stop_in_store import STOP_KEY

    dead_after = 6.0
    with ElasticJob(tmp_path / "job", max_steps=100_000, step_seconds=0.1, dead_after=dead_after,
                    fit_args=("--stop-in-store",), warm=True) as job:
        first = job.start_launch(2)
        job.wait_for(lambda: job.step() >= 2, what="the first world to train")
        host = job.start_launch(2, node_rank=1)
        job.wait_for(lambda: job.installed_size() == 4, what="the grow to 4", timeout=120)
        at = job.step()
        job.wait_for(lambda: job.step() >= at + 3, what="world 4 to train")
        for proc in host:
            proc.send_signal(signal.SIGSTOP)
        job.wait_for(lambda: job.installed_size() == 2, what="the survivors' world", timeout=90)
        step = job.step()
        job.wait_for(lambda: job.step() >= step + 5, what="the survivors to train on", timeout=60)
        for proc in host:
            proc.send_signal(signal.SIGCONT)
        stopped_codes = [job.wait(proc, timeout=60) for proc in host]
        spare = job.start_python()  # a replacement joins as any joiner does: the policy grows the world
        job.wait_for(lambda: job.installed_size() == 3, what="the spare to join", timeout=120)
        job.client.store.set(STOP_KEY, str(job.step() + 3))
        codes = [job.wait(p) for p in [*first, spare]]
        results, log = job.results(), job.text()
    assert codes == [0, 0, 0], log
    assert all(code not in (0, -signal.SIGKILL) for code in stopped_codes), (stopped_codes, log)
    out = set(re.findall(r"^\[dynatrain\] this process \((\S+)\) was recorded as failed", log, re.MULTILINE))
    assert len(out) == 2, log  # each stopped process, continued, says it is out of the job
    silences = [float(x) for x in re.findall(r"\[dynatrain store\] member \S+ failed: silent for ([0-9.]+) s", log)]
    # the first is named past dead_after; the other with it, silent nearly as long (the store's
    # ``together``: min(2 s, dead_after / 2), as the two said they were alive up to a heartbeat apart)
    assert len(silences) == 2 and dead_after <= max(silences) <= dead_after + 2, (silences, log)
    assert all(dead_after - min(2.0, dead_after / 2) <= x for x in silences), (silences, log)
    assert "its process ended" not in log, log
    assert {r["world"] for r in results.values()} == {3}
    for r in results.values():  # every process holds the job's history: the recovery, then the grow
        assert [(x["src"], x["dst"], len(x["failed"])) for x in r["recoveries"]] == \
            [("dp2-tp2-pp1", "dp2-tp1-pp1", 2)], r["recoveries"]
        assert r["changes"][-1]["src"] == "dp2-tp1-pp1", r["changes"]
    print(f"lost host: named after {silences} s of silence (dead_after {dead_after} s)")


def test_a_torchrun_worker_killed_takes_its_launch_down_in_one_change(tmp_path):
    """World 4 from two torchrun launches of two; one worker of the second is SIGKILLed. The store
    knows at once (its liveness connection closed) and records its sibling in the same record:
    torchrun's agent stops the whole launch (SIGTERM to the sibling, which does not leave, a second
    change the agent would cut short, but ends at once). The first launch recovers from both, once,
    from its replicas, and trains on at world 2."""
    from benchmarks.stop_in_store import STOP_KEY

    with ElasticJob(tmp_path / "job", max_steps=100_000, step_seconds=0.1, dead_after=10.0, suspect_after=2.0,
                    fit_args=("--stop-in-store",), warm=True) as job:
        first = job.start_torchrun(2)
        job.wait_for(lambda: job.step() >= 2, what="the first world to train")
        second = job.start_torchrun(2)
        job.wait_for(lambda: job.installed_size() == 4, what="the grow to 4", timeout=120)
        at = job.step()
        job.wait_for(lambda: job.step() >= at + 3, what="world 4 to train")
        workers = _children(second.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        job.wait_for(lambda: job.installed_size() == 2, what="the first launch's world", timeout=90)
        at = job.step()
        job.wait_for(lambda: job.step() >= at + 3, what="world 2 to train", timeout=60)
        job.client.store.set(STOP_KEY, str(job.step() + 2))
        assert job.wait(first, timeout=120) == 0, job.tail(400)
        second_code = job.wait(second, timeout=60)
        results, log = job.results(), job.text()
    assert second_code != 0, log
    # the sibling learns it is out from the store's record, or torchrun's SIGTERM comes first
    assert "was recorded as failed" in log or "ends with it (the others recover its state" in log, log
    assert "handed its state off" not in log, log  # no leave
    assert {(r["world"], r["layout"]) for r in results.values()} == {(2, "dp2-tp1-pp1")}, log
    # the store knew the killed worker at once and named its sibling with it: torchrun ends the launch (the
    # sibling's own connection closes too when torchrun ends it within CLOSES_TOGETHER of the first)
    named = re.findall(r"\[dynatrain store\] member \S+ failed: (its process ended|a process of its launch ended)",
                       log)
    assert len(named) == 2 and named[0] == "its process ended", log
    for r in results.values():  # the two workers of the second launch named in one recovery
        assert [(len(x["failed"]), x["dst"]) for x in r["recoveries"]] == [(2, "dp2-tp1-pp1")], r["recoveries"]
        assert r["changes"][-1]["dst"] == "dp2-tp2-pp1", r["changes"]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry.name))
    return sorted(found)


def test_a_member_killed_in_a_layout_switch_that_keeps_the_old_state_is_recovered_from(tmp_path, static_losses):
    """``switch_safety="keep_old"``: rank 3 kills itself entering the transfer of the scheduled switch
    to ``dp1-tp2-pp2`` after step ``FAULT_STEP``. Nothing was freed: the survivors go on from the
    old layout's state of that step, at ``dp3-tp1-pp1``."""
    fault = {3: {"DYNATRAIN_SWITCH_FAULT": "3:transfer:KILL:1"}}
    fit_args = ("--switch-safety", "keep_old", "--switch-timeout", "20", "--schedule", f"{FAULT_STEP}:dp1-tp2-pp2")
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.0, dead_after=10.0, suspect_after=2.0,
                    fit_args=fit_args, warm=True) as job:
        procs = job.start_launch(4, rank_env=fault)
        codes = [job.wait(p) for p in procs]
        results, log = job.results(), job.text()
    assert codes == [0, 0, 0, -signal.SIGKILL], log
    assert {(r["world"], r["layout"], r["global_step"]) for r in results.values()} == {(3, "dp3-tp1-pp1", MAX_STEPS)}
    assert len({r["shard"] for r in results.values()}) == 1
    assert {(x["step"], x["src"], x["dst"], x["steps_redone"]) for r in results.values() for x in r["recoveries"]} \
        == {(FAULT_STEP, "dp2-tp2-pp1", "dp3-tp1-pp1", 0)}
    for r in results.values():
        assert [step for step, _ in r["losses"]] == list(range(1, MAX_STEPS + 1))
        for step, loss in r["losses"]:
            if step <= FAULT_STEP:
                assert loss == static_losses[step], step
            else:
                assert loss == pytest.approx(static_losses[step], rel=1e-4), step


def test_members_killed_in_rollout_phases_are_recovered_from_the_replicas_or_from_the_snapshot(
        tmp_path, static_run, static_losses):
    """Every step samples a few tokens in a rollout phase at ``dp<world>-tp1-pp1`` before its update,
    with snapshots every 3 steps. Rank 3 kills itself inside step ``FAULT_STEP``'s phase, which kept
    the training weights: the survivors recover from the replicas of step ``FAULT_STEP - 1`` (the phase
    left the training state as it was), drop the phase's results and run the step again at
    ``dp3-tp1-pp1``, its rollout included. From step ``FREES_FROM`` on the phases free the training
    shards of the weights (``keep_weights=False``), and rank 2 kills itself inside step ``FREES_FROM``'s:
    no survivor holds the weights of step ``FREES_FROM - 1`` at the training layout any more, so the
    two go back to the snapshot of step 6 (the state the job had after step 6, bit for bit, as megatron
    describes it), compute steps 7-8 again at ``dp2-tp1-pp1`` and run the interrupted step.
    The oracle is the static fit, which never entered a rollout: the same samples, every loss before
    the first kill bit for bit, each step once."""
    frees_from = FREES_FROM
    fit_args = ("--rollout-every", "1", "--kill-in-rollout", f"3:{FAULT_STEP},2:{frees_from}",
                "--rollout-frees-weights-from", str(frees_from), "--snapshot-every", "3", "--describe-recovered",
                "--describe-at", "6")
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.0, dead_after=10.0, suspect_after=2.0,
                    fit_args=fit_args, warm=True) as job:
        procs = job.start_launch(4)
        codes = [job.wait(p) for p in procs]
        results, log = job.results(), job.text()
        # the last recovery's state (the snapshot of step 6, as the two survivors described it) is the
        # state the job trained to after step 6 (at dp3-tp1-pp1 after the first recovery: not the static
        # fit's bits), as the three processes alive then described it
        survivors = [p.pid for p, code in zip(procs, codes) if code == 0]
        recovered = assemble(job.described("recovered", pids=survivors))
        at_step_6 = assemble(job.described("described.6"))
    assert codes == [0, 0, -signal.SIGKILL, -signal.SIGKILL], log
    assert recovered and differences(recovered, at_step_6) == []
    assert {(r["world"], r["layout"], r["global_step"]) for r in results.values()} == {(2, "dp2-tp1-pp1", MAX_STEPS)}
    recoveries = [[(x["step"], x["src"], x["dst"], x["snapshot_step"], x["steps_redone"]) for x in r["recoveries"]]
                  for r in results.values()]
    assert recoveries == [[(FAULT_STEP - 1, "dp2-tp2-pp1", "dp3-tp1-pp1", None, 0),
                           (frees_from - 1, "dp3-tp1-pp1", "dp2-tp1-pp1", 6, frees_from - 7)]] * 2, log
    assert f"step {FAULT_STEP - 1}: a member died during the rollout; the survivors went on at dp3-tp1-pp1" in log, log
    assert f"step {frees_from - 1}: a member died during the rollout; the survivors went on at dp2-tp1-pp1" in log, log
    assert f"{frees_from - 7} step(s) redone from the in-memory snapshot of step 6" in log, log
    _same_samples(results, static_run)
    for r in results.values():
        assert r["rollouts"] == list(range(1, MAX_STEPS + 1))  # each step's phase ended once (the lost ones dropped)
        assert [step for step, _ in r["losses"]] == list(range(1, MAX_STEPS + 1))
        for step, loss in r["losses"]:
            if step < FAULT_STEP:
                assert loss == static_losses[step], step
            else:
                assert loss == pytest.approx(static_losses[step], rel=1e-4), step
