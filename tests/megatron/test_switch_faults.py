"""A rank lost in the middle of a hot switch: every survivor raises ``SwitchFailedError`` within the deadline.

Launcher: one plain process per rank running ``switch_fault_job.py`` (``WarmScript``: forked from a
server that imported torch and megatron-core once), with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` set here. Lightning's launcher and torchrun's agent stop every rank when one dies,
which would hide what the survivors do on their own.

4 ranks, gloo, a real megatron GPT switching dp4-zero1 -> dp1-tp2-pp2 (every rank needs optimizer
state from every other: the survivors exchange with the victim) under a ``SwitchWatch`` with a
fixed deadline. ``DYNATRAIN_SWITCH_FAULT`` makes rank 2 send itself SIGKILL (or SIGSTOP) as
it enters the transfer phase; the test notes when it died (or stopped) and requires every survivor
to raise ``SwitchFailedError`` naming rank 2 and the transfer phase within the deadline (plus the
heartbeat's window to name it), say the state is lost and name the checkpoint, and exit cleanly.
One test kills it earlier, as the first switch makes its own group (phase ``groups``). A SIGKILL in
the transfer is run under ``keep_old`` here (the survivors free nothing, the dead rank's part is
gone); under the default fast mode it is ``tests/strategy/test_switch_fault_fit.py``'s, in a fit.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from benchmarks.baselines.launch import WarmScript
from tests.dist import free_port

SCRIPT = Path(__file__).with_name("switch_fault_job.py")
ROOT = Path(__file__).resolve().parents[2]
WORLD, VICTIM = 4, 2
DEADLINE_S = 12.0
pytestmark = pytest.mark.slow


def _state(pid: int) -> str:
    """The process state letter from /proc ('T' stopped, 'Z' zombie), '' once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return ""


def _run(tmp_path: Path, how: str, *, timeout_s: float, deadline_s: float = DEADLINE_S, extra: tuple[str, ...] = (),
         resume_after: float | None = None, phase: str = "transfer") -> tuple[float, list[dict]]:
    """Start the ranks, note when the victim died or stopped (and continue it ``resume_after``
    seconds later), wait for the others; every process still there at the end is killed. Returns
    (time of the fault, results of every rank that ended, in rank order)."""
    port = free_port()
    procs: list[WarmScript] = []
    start = time.monotonic()
    try:
        for rank in range(WORLD):
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_"))}
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                       DYNATRAIN_SWITCH_FAULT=f"{VICTIM}:{phase}:{how}", OMP_NUM_THREADS="1",
                       PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
            procs.append(WarmScript(SCRIPT, [str(tmp_path), "--deadline", str(deadline_s), "--src", "dp4-tp1-pp1-zero1",
                                             "--dst", "dp1-tp2-pp2", *extra],
                                    env=env, cwd=ROOT, log=tmp_path / f"rank{rank}.log"))
        victim = procs[VICTIM]
        t_fault, waiting = None, [p for i, p in enumerate(procs) if i != VICTIM or resume_after is not None]
        while time.monotonic() - start < timeout_s:
            if t_fault is None and (victim.poll() is not None or _state(victim.pid) == "T"):
                t_fault = time.time()
            if resume_after is not None and t_fault is not None and time.time() > t_fault + resume_after:
                victim.send_signal(signal.SIGCONT)
            if all(p.poll() is not None for p in waiting):
                break
            time.sleep(0.05)
        else:
            logs = "\n".join(f"--- rank {r}\n" + (tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD))
            raise AssertionError(f"the survivors did not end within {timeout_s:.0f} s\n{logs}")
        assert t_fault is not None, "rank 2 never died or stopped"
        survivors = []
        for rank in range(WORLD):
            if procs[rank] not in waiting:
                continue
            assert procs[rank].returncode == 0, (tmp_path / f"rank{rank}.log").read_text()[-4000:]
            survivors.append(json.loads((tmp_path / f"rank{rank}.json").read_text()))
        return t_fault, survivors
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
                p.wait(timeout=10)


def _check(t_fault: float, survivors: list[dict]) -> list[float]:
    seconds = []
    for r in survivors:
        assert r["error"] == "SwitchFailedError", r["message"]
        assert r["missing"] == VICTIM and r["phase"] == "transfer", r["message"]
        assert r["lost_state"] and r["resume_from"] == "/checkpoints/last", r["message"]
        assert f"rank {VICTIM} stopped answering in phase 'transfer'" in r["message"], r["message"]
        assert "/checkpoints/last" in r["message"]
        seconds.append(r["t_error"] - t_fault)
        assert t_fault < r["t_error"] < r["t_exit"], r  # the error after the fault, the exit after the error
    # (the seconds are a figure, printed, not a bound: the deadline itself is tests/transition/test_deadline.py's)
    print(f"seconds from the fault to each survivor's SwitchFailedError: {[round(s, 1) for s in seconds]}")
    return seconds


def test_stopped_rank_in_transfer(tmp_path: Path) -> None:
    """SIGSTOP: nothing closes; the waits on it fail at the deadline, the others learn it from the abort flag."""
    t_fault, survivors = _run(tmp_path, "STOP", timeout_s=240)
    _check(t_fault, survivors)


def test_killed_rank_before_the_switch_group_is_made(tmp_path: Path) -> None:
    """SIGKILL as the first switch's own group is made: the survivors' group creation fails at the
    deadline (torch's error names no rank); each names rank 2, which never said it came, phase
    ``groups``, and the state counts as lost (a rank holding part of it is gone)."""
    t_fault, survivors = _run(tmp_path, "KILL", timeout_s=240, phase="groups")
    for r in survivors:
        assert r["error"] == "SwitchFailedError", r["message"]
        assert (r["missing"], r["phase"], r["lost_state"]) == (VICTIM, "groups", True), r["message"]
        assert f"rank(s) [{VICTIM}] did not come" in r["message"] and "/checkpoints/last" in r["message"], r["message"]
        assert t_fault < r["t_error"] < r["t_exit"], r  # the error after the fault, the exit after the error
    print(f"seconds from the fault to each survivor's SwitchFailedError: "
          f"{[round(r['t_error'] - t_fault, 1) for r in survivors]}")


def test_keep_old_rolls_back_when_a_rank_stalls_past_the_deadline(tmp_path: Path) -> None:
    """Safe mode (``keep_old``): rank 2 stalls (SIGSTOP) in the transfer phase for longer than a 6 s
    deadline, then goes on (SIGCONT) while the others are still finding out who is missing. Every
    rank, rank 2 included, raises ``SwitchFailedError`` with the state not lost (marked refused),
    holds its old state bit for bit, and a second switch (a new watch) succeeds: training goes on."""
    deadline = 6.0
    t_fault, ranks = _run(tmp_path, "STOP", timeout_s=240, deadline_s=deadline, resume_after=deadline + 1.0,
                          extra=("--keep-old", "--stale-after", "4"))
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    for r in ranks:
        assert r["error"] == "SwitchFailedError", r["message"]
        assert r["missing"] is None and not r["lost_state"] and r["refused"], r["message"]
        assert "with every rank still alive" in r["message"] and "state is whole on every rank" in r["message"]
        assert r["old_state_whole"], f"rank {r['rank']}: the rolled-back state differs from the state before"
        assert r["retried"] == "dp1-tp2-pp2", r
    print(f"seconds from the stall to each rank's SwitchFailedError: {[round(r['t_error'] - t_fault, 1) for r in ranks]}")


def test_keep_old_with_a_killed_holder_says_which_part_went_with_it(tmp_path: Path) -> None:
    """Safe mode and a SIGKILL in the transfer: the survivors' connections to it close; each names
    rank 2 once its heartbeat stops. No survivor freed anything, but rank 2's part of the old state
    (dp4-zero1: its optimizer shard) went with it; the error says so, not that the switch freed
    the state."""
    t_fault, survivors = _run(tmp_path, "KILL", timeout_s=240, extra=("--keep-old",))
    _check(t_fault, survivors)
    for r in survivors:
        assert f"no rank freed its old state, but the part rank {VICTIM} held went with it" in r["message"], \
            r["message"]
        assert "frees the old state" not in r["message"], r["message"]
