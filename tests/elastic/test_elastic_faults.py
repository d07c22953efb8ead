"""Bad input and faults in a running elastic fit (real store process, torchrun, Lightning, gloo).

One job, in order: a joiner without the job's token and a joiner of another model are refused with
the reason and change nothing; a joiner that stops answering while the world that admits it is
being built only cancels that change, and so does one that stops once its peers build the target's
model ahead; a member that dies instead of leaving stops the job within a
bounded time, with an error that names it. In jobs of their own: a joiner killed as the transfer
that fills it starts, and a leaver killed as the transfer that hands its state off starts (world
changes run under the switch watch), fail the change on every survivor with ``SwitchFailedError``
naming the rank and the phase; a joiner that stalls at the start of the switch that fills it stops
the job within the heartbeat and watchdog bounds, naming it.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from benchmarks.elastic_job import ElasticJob

pytestmark = pytest.mark.slow

DEAD_AFTER = 4.0
#: benchmarks/elastic_fit.py's OnNodeChange(exit_after=...): survivors stuck in a collective end after it
EXIT_AFTER = 20.0


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


def test_refused_joiners_a_joiner_dying_in_the_build_and_a_member_dying_instead_of_leaving(tmp_path):
    with ElasticJob(tmp_path / "job", max_steps=100_000, step_seconds=0.2, dead_after=DEAD_AFTER) as job:
        first = job.start_torchrun(2)
        job.wait_for(lambda: job.step() >= 3, what="the first world to train")
        members = job.installed()

        intruder = job.start_python(env={"DYNATRAIN_TOKEN": "guessed"})
        other_model = job.start_python("--fingerprint-salt", "another model")
        assert job.wait(intruder) != 0 and job.wait(other_model) != 0
        log = job.tail(400)
        assert "not signed with this job's token" in log
        assert "its model, recipe or package version differs from the job's" in log
        assert job.client.generation() == 0 and job.installed() == members  # no rank, no generation

        # it stops answering once admitted, while the world that admits it is built (the session's hook
        # stops it there: a SIGSTOP sent from here could come after the world was installed)
        _a_joiner_stops_and_only_its_change_is_cancelled(job, "STOP", members, first)
        # one stops later, once its peers build the next world's target ahead: that change is cancelled too
        _a_joiner_stops_and_only_its_change_is_cancelled(job, "STOP_IN_BUILD", members, first)
        assert "building dp3-tp1-pp1 ahead" in job.tail(400)

        member = job.start_python()
        job.wait_for(lambda: job.installed_size() == 3, what="a joiner (world 3)")
        victim = job.installed()[2]
        member.send_signal(signal.SIGTERM)  # asked to leave ...
        member.kill()  # ... it dies instead
        killed_at = time.monotonic()
        code = job.wait(first, timeout=120)
        stopped_after = time.monotonic() - killed_at
        log = job.tail(400)
    assert code != 0
    # the survivors say who failed: raised from the step (MemberFailedError) or, when they are stuck in a
    # collective, printed by the session's watchdog before it ends the process
    assert re.search(rf"(MemberFailedError: |\[dynatrain\] (ending this process \(75\): )?)member\(s\) "
                     rf"{re.escape(victim)} \(rank 2\) stopped answering", log), log
    assert stopped_after < DEAD_AFTER + EXIT_AFTER + 20, f"the job took {stopped_after:.0f} s to stop"


def test_a_joiner_stalled_inside_the_switch_that_fills_it_stops_the_job_within_a_bounded_time(tmp_path):
    with ElasticJob(tmp_path / "job", max_steps=100_000, step_seconds=0.2, dead_after=DEAD_AFTER) as job:
        first = job.start_torchrun(2)
        job.wait_for(lambda: job.step() >= 3, what="the first world to train")
        stalled = job.start_python(env={"DYNATRAIN_JOIN_FAULT": "STOP_IN_SWITCH"})
        job.wait_for(lambda: job.installed_size() == 3, what="the world with the joiner to be installed")
        installed_at, victim = time.monotonic(), job.installed()[2]
        code = job.wait(first, timeout=120)
        stopped_after = time.monotonic() - installed_at
        log = job.tail(400)
        stalled.kill()
    assert code != 0, log
    assert re.search(rf"(MemberFailedError: |\[dynatrain\] (ending this process \(75\): )?)member\(s\) "
                     rf"{re.escape(victim)} \(rank 2\) stopped answering", log), log
    assert stopped_after < DEAD_AFTER + EXIT_AFTER + 20, f"the job took {stopped_after:.0f} s to stop"


@pytest.mark.parametrize("fault", ["joining", "leaving"])
def test_a_process_killed_in_the_transfer_of_a_world_change_fails_it_naming_its_rank(tmp_path, fault):
    """Rank 2 of world 3 (the joiner) kills itself entering the transfer of the grow that fills it
    (its watch's switch 1), or of the shrink it leaves by (switch 2, after SIGTERM)."""
    switch, change = (1, "dp2-tp1-pp1 -> dp3-tp1-pp1") if fault == "joining" else (2, "dp3-tp1-pp1 -> dp2-tp1-pp1")
    with ElasticJob(tmp_path / "job", max_steps=100_000, step_seconds=0.2, dead_after=DEAD_AFTER) as job:
        first = job.start_torchrun(2)
        job.wait_for(lambda: job.step() >= 3, what="the first world to train")
        killed = job.start_python(env={"DYNATRAIN_SWITCH_FAULT": f"2:transfer:KILL:{switch}"})
        job.wait_for(lambda: job.installed_size() == 3, what="the world with the joiner to be installed")
        if fault == "leaving":
            at = job.step()
            job.wait_for(lambda: job.step() >= at + 3, what="world 3 to train")
            killed.send_signal(signal.SIGTERM)  # it leaves: the shrink's switch runs over world 3
        started = time.monotonic()
        code = job.wait(first, timeout=120)
        stopped_after = time.monotonic() - started
        log = job.tail(400)
        assert job.wait(killed) == -signal.SIGKILL, log
    assert code != 0, log
    failures = re.findall(rf"SwitchFailedError: layout switch {change} failed: rank 2 stopped answering in phase "
                          r"'transfer'", log)
    assert len(failures) >= 2, log  # on both survivors
    assert stopped_after < DEAD_AFTER + EXIT_AFTER + 20, f"the job took {stopped_after:.0f} s to stop"
