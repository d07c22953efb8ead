"""A ``trainer.fit`` whose scheduled switch loses a rank ends on every survivor with ``SwitchFailedError``.

Launcher: one process per rank running ``switch_fault_fit.py`` (``WarmScript``: forked from a server
that imported torch, megatron-core and Lightning once) with Lightning's own variables set here, so no
launcher runs (Lightning's and torchrun's would stop every rank when one dies). 4 ranks, gloo,
megatron on CPU, a real ``Trainer`` with a ``ModelCheckpoint`` saving every step and a
``ScheduledReconfig`` switching dp4-zero1 -> dp1-tp2-pp2 after step 2;
``DYNATRAIN_SWITCH_FAULT`` kills rank 2 (SIGKILL) as it enters the switch's transfer phase.

Every survivor's ``fit`` must end, within the switch timeout of the kill, with ``SwitchFailedError``
naming rank 2 and the transfer phase, saying the state is lost and naming the last checkpoint (step
1's: Lightning runs ``ModelCheckpoint`` after the other callbacks, so step 2's switch comes first);
Lightning's teardown must destroy the process group and the process must exit with the error.

With ``switch_safety="keep_old"`` a rank that stalls past the deadline (SIGSTOP, then SIGCONT) makes
the switch fail on every rank with the old state whole: the fit goes on at the old layout, and every
later step's loss is the one of a fit that never tried the switch.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import time
from pathlib import Path

import pytest

from benchmarks.baselines.launch import WarmScript
from tests.dist import free_port

SCRIPT = Path(__file__).with_name("switch_fault_fit.py")
ROOT = Path(__file__).resolve().parents[2]
WORLD, VICTIM, SWITCH_TIMEOUT = 4, 2, 20.0
pytestmark = pytest.mark.slow


def _start(tmp_path: Path, *args: str, fault: str | None = None) -> list[WarmScript]:
    """One process per rank of ``switch_fault_fit.py OUT *args``, with ``DYNATRAIN_SWITCH_FAULT=fault``."""
    port, procs = free_port(), []
    tmp_path.mkdir(parents=True, exist_ok=True)
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "TORCHELASTIC_",
                                    "SLURM_", "DYNATRAIN_", "OMP_NUM_THREADS"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                   WORLD_SIZE=str(WORLD), PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
        if fault is not None:
            env["DYNATRAIN_SWITCH_FAULT"] = fault
        procs.append(WarmScript(SCRIPT, [str(tmp_path), *args], env=env, cwd=ROOT, log=tmp_path / f"rank{rank}.log"))
    return procs


def _wait(tmp_path: Path, procs: list[WarmScript], limit_s: float, tick=lambda: None) -> None:
    """Until every process ended (``tick`` runs every 50 ms meanwhile); their logs in the error past ``limit_s``."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        tick()
        if all(p.poll() is not None for p in procs):
            return
        time.sleep(0.05)
    logs = "\n".join(f"--- rank {r}\n" + (tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD))
    raise AssertionError(f"the ranks did not end within {limit_s:.0f} s\n{logs}")


def _kill(procs: list[WarmScript]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(timeout=10)


def test_fit_survivors_end_with_switch_failed(tmp_path: Path) -> None:
    procs = _start(tmp_path, "--switch-timeout", str(SWITCH_TIMEOUT), fault=f"{VICTIM}:transfer:KILL")
    try:
        t_kill = None

        def note_the_kill() -> None:
            nonlocal t_kill
            if t_kill is None and procs[VICTIM].poll() is not None:
                t_kill = time.time()

        _wait(tmp_path, procs, 300.0, note_the_kill)
        assert procs[VICTIM].returncode == -9, (tmp_path / f"rank{VICTIM}.log").read_text()[-3000:]
        assert t_kill is not None
        seconds = []
        for rank in (r for r in range(WORLD) if r != VICTIM):
            log = (tmp_path / f"rank{rank}.log").read_text()
            assert procs[rank].returncode == 1, log[-4000:]
            assert "SwitchFailedError: layout switch dp4-tp1-pp1-zero1 -> dp1-tp2-pp2 failed" in log, log[-4000:]
            r = json.loads((tmp_path / f"rank{rank}.json").read_text())
            assert r["missing"] == VICTIM and r["phase"] == "transfer" and r["lost_state"], r["message"]
            assert r["resume_from"] and Path(r["resume_from"]).name == "epoch=0-step=1.ckpt", r["message"]
            assert r["resume_from"] in r["message"]
            assert not r["dist_after"], "Lightning's teardown destroys the process group"
            seconds.append(r["t_error"] - t_kill)
        # (how long they took is a figure, printed: benchmarks/ measure it; the order is what a test asserts)
        print(f"seconds from the kill to each survivor's SwitchFailedError: {[round(s, 1) for s in seconds]}")
        assert min(seconds) > 0, seconds  # each survivor failed after the kill, not before it
        # the step whose switch ended the fit is in the metrics too (logged before the error went up)
        with open(tmp_path / "logs" / "metrics" / "version_0" / "metrics.csv", newline="") as f:
            logged = [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]
        assert logged == [0, 1], logged  # batches 0 and 1: the switch came after global step 2
    finally:
        _kill(procs)


def test_keep_old_fit_goes_on_at_the_old_layout_as_if_it_never_tried(tmp_path: Path) -> None:
    deadline, steps = 8.0, 5
    never_tried = _start(tmp_path / "never", "--no-switch", "--steps", str(steps))
    try:
        _wait(tmp_path / "never", never_tried, 240.0)
    finally:
        _kill(never_tried)
    stalled = _start(tmp_path / "keep_old", "--keep-old", "--switch-timeout", str(deadline), "--steps", str(steps),
                     fault=f"{VICTIM}:transfer:STOP")
    try:
        t_stop = None

        def stop_then_continue() -> None:  # the stall outlasts the deadline, then the rank goes on
            nonlocal t_stop
            if t_stop is None and _process_state(stalled[VICTIM].pid) == "T":
                t_stop = time.monotonic()
            if t_stop is not None and time.monotonic() > t_stop + deadline + 0.5:
                stalled[VICTIM].send_signal(signal.SIGCONT)

        _wait(tmp_path / "keep_old", stalled, 300.0, stop_then_continue)
    finally:
        _kill(stalled)
    assert t_stop is not None, "rank 2 never stalled"
    for rank in range(WORLD):
        log = (tmp_path / "keep_old" / f"rank{rank}.log").read_text()
        assert stalled[rank].returncode == 0 and never_tried[rank].returncode == 0, log[-4000:]
        tried = json.loads((tmp_path / "keep_old" / f"rank{rank}.json").read_text())
        never = json.loads((tmp_path / "never" / f"rank{rank}.json").read_text())
        assert tried["switches"] == [] and tried["layout"] == never["layout"] == "dp4-tp1-pp1-zero1", tried
        assert [s for s, _ in tried["losses"]] == list(range(1, steps + 1))  # (global step after each step)
        assert tried["losses"] == never["losses"], rank  # bit for bit: the rolled-back state is the old one
    assert "state is whole on every rank" in (tmp_path / "keep_old" / "rank0.log").read_text()


def _process_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (``T``: stopped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"
