"""Bad input and faults in a running elastic fit (real store process, torchrun, Lightning, gloo).

One job under ``switch_safety="keep_old"``, in order: a joiner without the job's token and a joiner
of another model are refused with the reason and change nothing; a joiner that stops answering
while the world that admits it is being built only cancels that change, and so does one that stops
once its peers build the target's model ahead; a joiner that stalls before its switch moved
anything and one killed in its transfer each send the old members back to their world, where
training goes on as if no joiner had come (bit for bit against a fit that never grew). A member
that dies instead of leaving: ``tests/elastic/test_recovery_fit.py``, which checks a recovery's
state against a static fit; the store naming it: ``tests/elastic/test_store.py``.
In jobs of their own: a joiner killed as the transfer that fills it starts fails the change on every
survivor with ``SwitchFailedError`` naming the rank and the phase (world changes run under the
switch watch); a leaver killed before its hand-off moved anything leaves the others training on the
replicas they hold (a leaver killed once state was freed, with snapshots:
``tests/elastic/test_recovery_fit.py``); with snapshots, a grow whose joiner died after the old
members freed state goes back to the old world and the snapshot, and its losses are those of a fit
that never grew (the same never-grown fit as the first job's).
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from benchmarks.stop_in_store import STOP_KEY
from benchmarks.elastic_job import ElasticJob

pytestmark = pytest.mark.slow

DEAD_AFTER = 4.0
MAX_STEPS = 100_000  # a bound only: the store ends each fit (``--stop-in-store``)
SWITCH_TIMEOUT = 10.0


def _latest(job: ElasticJob):
    return job.client.membership(job.client.generation())


def _a_joiner_stops_and_only_its_change_is_cancelled(job: ElasticJob, fault: str, members: tuple, first) -> None:
    """A joiner stopped by the session's hook ``fault`` (``DYNATRAIN_JOIN_FAULT``): its change is
    cancelled and training goes on at the running world."""
    stalled = job.start_python(env={"DYNATRAIN_JOIN_FAULT": fault})
    job.wait_for(lambda: len(_latest(job).members) == 3, what=f"the generation of the joiner stopped at {fault}")
    job.wait_for(lambda: _latest(job).dropped != (), what="the change to be cancelled", timeout=60)
    step = job.step()
    job.wait_for(lambda: job.step() >= step + 10, what="training to go on at world 2", timeout=60)
    assert job.installed() == members and first.poll() is None
    stalled.kill()


class NeverGrown:
    """The losses of a fit of two processes that never grew (``--static``: the same model, data and
    global batches at ``dp2-tp1-pp1``, and the same ``max_steps``: the learning-rate schedule follows
    it), ended by the store as the tests' jobs are; run once to the longest count a test asked for."""

    def __init__(self, out) -> None:
        self.out, self.losses = out, {}

    def upto(self, steps: int) -> dict[int, float]:
        if len(self.losses) < steps:
            with ElasticJob(self.out / f"static{steps}", max_steps=MAX_STEPS, step_seconds=0.0,
                            fit_args=("--static", "--stop-in-store")) as job:
                job.client.store.set(STOP_KEY, str(steps))
                assert job.wait(job.start_torchrun(2)) == 0, job.tail()
                (losses,) = {tuple(map(tuple, r["losses"])) for r in job.results().values()}  # the ranks agree
            self.losses = dict(losses)
        return {step: loss for step, loss in self.losses.items() if step <= steps}


@pytest.fixture(scope="module")
def never_grown(tmp_path_factory) -> NeverGrown:
    return NeverGrown(tmp_path_factory.mktemp("never_grown"))


def test_bad_joiners_change_nothing_and_grows_that_fail_go_back_to_the_old_world_as_if_never_tried(tmp_path,
                                                                                                    never_grown):
    """``switch_safety="keep_old"``, a switch deadline of ``SWITCH_TIMEOUT``, one job of two processes.
    A joiner without the job's token and a joiner of another model are refused with the reason. A
    joiner that stops answering while the world that admits it is built, and one that stops once its
    peers build the target's model ahead, only cancel their change (named after the store's
    ``dead_after``). One joiner stalls (SIGSTOP) at the start of the switch that fills it, before
    anything moved; the next one kills itself as it enters that switch's transfer: each time the old
    members go back to their world of 2 with their state whole and train on; the store cancels the
    change once the joiner's heartbeat stops. A last joiner then enters. Every loss before it joined
    equals, bit for bit, a fit that never saw a joiner."""
    fit_args = ("--switch-safety", "keep_old", "--switch-timeout", str(SWITCH_TIMEOUT), "--stop-in-store")
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.2, dead_after=DEAD_AFTER,
                    fit_args=fit_args, warm=True) as job:
        first = job.start_torchrun(2)
        job.wait_for(lambda: job.step() >= 3, what="the first world to train")
        members = job.installed()

        intruder = job.start_python(env={"DYNATRAIN_TOKEN": "guessed"})
        other_model = job.start_python("--fingerprint-salt", "another model")
        assert job.wait(intruder) != 0 and job.wait(other_model) != 0
        log = job.text()
        assert "not signed with this job's token" in log
        assert "its model, recipe or package version differs from the job's" in log
        assert job.client.generation() == 0 and job.installed() == members  # no rank, no generation
        # it stops answering once admitted, while the world that admits it is built (the session's hook
        # stops it there: a SIGSTOP sent from here could come after the world was installed)
        _a_joiner_stops_and_only_its_change_is_cancelled(job, "STOP", members, first)
        # one stops later, once its peers build the next world's target ahead: that change is cancelled too
        _a_joiner_stops_and_only_its_change_is_cancelled(job, "STOP_IN_BUILD", members, first)
        assert "building dp3-tp1-pp1 ahead" in job.text()

        faulty = [job.start_python(env={"DYNATRAIN_JOIN_FAULT": "STOP_IN_SWITCH"})]
        _goes_back(job, members, first)
        faulty.append(job.start_python(env={"DYNATRAIN_SWITCH_FAULT": "2:transfer:KILL:1"}))
        _goes_back(job, members, first)
        assert job.wait(faulty[1]) == -signal.SIGKILL
        faulty[0].kill()
        later = job.start_python()
        job.wait_for(lambda: job.installed_size() == 3, what="a later joiner (world 3)")
        stop = job.step() + 10
        job.client.store.set(STOP_KEY, str(stop))
        codes = [job.wait(first), job.wait(later)]
        results, log = job.results(), job.text()
    assert codes == [0, 0], log
    assert len(results) == 3 and {r["global_step"] for r in results.values()} == {stop}, log
    assert {(r["world"], r["layout"]) for r in results.values()} == {(3, "dp3-tp1-pp1")}
    assert len({r["shard"] for r in results.values()}) == 1  # the replicas are identical
    old_members = [r for r in results.values() if r["pid"] != later.pid]
    # (the later joiner has rank 0's record, with the rest of OnNodeChange's state)
    what = [[(b["step"], b["change"], b["layout"]) for b in r["rolled_back"]] for r in results.values()]
    assert len(what[0]) == 2 and what.count(what[0]) == 3, what  # the two cancelled before a switch: none
    for r in old_members:
        stalled, killed = r["rolled_back"]
        assert all(b["change"].startswith("world 2 -> 3") and b["layout"] == "dp2-tp1-pp1" for b in (stalled, killed))
        assert "SwitchFailedError" in stalled["error"] and "rank 2 stopped answering" in stalled["error"], stalled
        assert "rank 2 stopped answering in phase 'transfer'" in killed["error"], killed
        assert "state is whole" in killed["error"], killed
        (joined,) = r["changes"]
        assert (joined["src"], joined["dst"]) == ("dp2-tp1-pp1", "dp3-tp1-pp1")
    # the later joiner holds the grow that admitted it, as the old members do
    joins = [[(c["step"], c["change"], c["src"], c["dst"]) for c in r["changes"]] for r in results.values()]
    assert len(joins[0]) == 1 and joins.count(joins[0]) == 3, joins
    assert log.count("so it was rolled back") >= 2, log  # rank 0 warned, at each
    joined_at = old_members[0]["changes"][0]["step"]

    reference = never_grown.upto(stop)
    seen = dict(tuple(x) for r in old_members for x in r["losses"])
    assert sorted(seen) == list(range(1, stop + 1))
    for step, loss in seen.items():
        if step <= joined_at:  # the old world all along: its state as if the joiners had never come
            assert loss == reference[step], f"step {step}"
        else:  # at world 3, from the same state
            assert loss == pytest.approx(reference[step], rel=1e-4), f"step {step}"


def _goes_back(job: ElasticJob, members: tuple, first) -> None:
    """The joiner just started fails its grow: the store cancels it, world 2 trains on."""
    job.wait_for(lambda: len(_latest(job).members) == 3, what="the generation of the failing joiner")
    job.wait_for(lambda: _latest(job).dropped != (), what="the change to be cancelled", timeout=SWITCH_TIMEOUT + 60)
    step = job.step()
    job.wait_for(lambda: job.step() >= step + 5, what="training to go on at world 2", timeout=60)
    assert job.installed() == members and first.poll() is None


def test_a_joiner_killed_in_the_transfer_that_fills_it_fails_the_grow_naming_its_rank(tmp_path):
    """Rank 2 of world 3 (the joiner) kills itself entering the transfer of the grow that fills it
    (its watch's switch 1): the old members freed state as they sent it, so the grow fails on both."""
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.2, dead_after=DEAD_AFTER, warm=True) as job:
        first = job.start_torchrun(2)
        job.wait_for(lambda: job.step() >= 3, what="the first world to train")
        killed = job.start_python(env={"DYNATRAIN_SWITCH_FAULT": "2:transfer:KILL:1"})
        # (the store hears of a grow's world once its state arrived: never, here)
        job.wait_for(lambda: len(_latest(job).members) == 3, what="the generation with the joiner")
        started = time.monotonic()
        code = job.wait(first, timeout=120)
        print(f"the old members stopped {time.monotonic() - started:.0f} s after the joiner's generation")
        log = job.text()
        assert job.wait(killed) == -signal.SIGKILL, log
    assert code != 0, log
    # (both survivors print to one log at once: a traceback's underline carets can land inside the
    # other's message, so they are left out before counting)
    failures = re.findall(r"SwitchFailedError: layout switch dp2-tp1-pp1 -> dp3-tp1-pp1 failed: rank 2 stopped "
                          r"answering in phase 'transfer'", log.replace("^", ""))
    assert len(failures) >= 2, log  # on both survivors


def test_a_grow_that_freed_state_and_lost_its_joiner_goes_back_to_the_snapshot(tmp_path, never_grown):
    """The same kill with ``OnNodeChange(snapshot_every=2)``: the two old members go back to their
    world and to the snapshot (their freed storages and gradient buffers get their memory back),
    compute the steps since again at ``dp2-tp1-pp1`` and train to the end: every loss is the one of a
    fit of two processes that never grew, bit for bit."""
    steps = 60
    static = never_grown.upto(steps)
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.2, dead_after=DEAD_AFTER,
                    fit_args=("--snapshot-every", "2", "--stop-in-store"), warm=True) as job:
        job.client.store.set(STOP_KEY, str(steps))
        first = job.start_torchrun(2)
        job.wait_for(lambda: job.step() >= 3, what="the first world to train")
        killed = job.start_python(env={"DYNATRAIN_SWITCH_FAULT": "2:transfer:KILL:1"})
        code = job.wait(first, timeout=240)
        results, log = job.results(), job.text()
        assert job.wait(killed) == -signal.SIGKILL, log
    assert code == 0, log
    assert "after freeing old state (only joiners were lost), so it was rolled back" in log, log
    back = re.search(r"step (\d+): the state went back to the in-memory snapshot of step (\d+); (\d+) step\(s\) "
                     r"redone", log)
    assert back is not None and int(back[1]) - int(back[2]) == int(back[3]) <= 2, log
    assert all([tuple(x) for x in r["losses"]] == sorted(static.items()) for r in results.values()), log


def test_a_leaver_killed_before_its_hand_off_moved_anything_leaves_the_others_training(tmp_path):
    """Rank 2 of world 3 asks to leave (SIGTERM) and kills itself entering the preflight of the
    shrink it leaves by (its watch's switch 2), before anything moved: the two others, already in
    their world of 2, rebuild the state from the data-parallel replicas they hold (nothing redone)
    and train on, to the end, at ``dp2-tp1-pp1``, identical replicas, one recovery naming it."""
    with ElasticJob(tmp_path / "job", max_steps=MAX_STEPS, step_seconds=0.2, dead_after=DEAD_AFTER,
                    fit_args=("--stop-in-store",), warm=True) as job:
        first = job.start_torchrun(2)
        job.wait_for(lambda: job.step() >= 3, what="the first world to train")
        killed = job.start_python(env={"DYNATRAIN_SWITCH_FAULT": "2:preflight:KILL:2"})
        job.wait_for(lambda: job.installed_size() == 3, what="the world with the joiner to be installed")
        at = job.step()
        job.wait_for(lambda: job.step() >= at + 3, what="world 3 to train")
        killed.send_signal(signal.SIGTERM)  # it leaves: the shrink's switch runs over world 3
        assert job.wait(killed, timeout=60) == -signal.SIGKILL, job.tail(200)
        job.wait_for(lambda: "lost; world 3 -> 2, dp3-tp1-pp1 -> dp2-tp1-pp1" in job.text(),
                     what="the survivors' recovery", timeout=60)
        stop = job.step() + 5
        job.client.store.set(STOP_KEY, str(stop))
        assert job.wait(first, timeout=120) == 0, job.tail(400)
        results, log = job.results(), job.text()
    survivors = [r for r in results.values() if r["pid"] != killed.pid]
    assert len(survivors) == 2, log
    assert {(r["world"], r["layout"], r["global_step"]) for r in survivors} == {(2, "dp2-tp1-pp1", stop)}, log
    assert len({r["shard"] for r in survivors}) == 1, log  # the replicas are identical
    for r in survivors:
        (recovery,) = r["recoveries"]
        assert (recovery["src"], recovery["dst"], recovery["steps_redone"], recovery["snapshot_step"]) == \
            ("dp3-tp1-pp1", "dp2-tp1-pp1", 0, None), recovery
        assert len(recovery["failed"]) == 1 and f":{killed.pid}:" in recovery["failed"][0], recovery
        assert [s for s, _ in r["losses"]] == list(range(1, stop + 1))  # each step once
    assert "SwitchFailedError" not in log.split("lost; world 3 -> 2")[-1], log
