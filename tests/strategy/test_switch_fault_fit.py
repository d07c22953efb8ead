"""A ``trainer.fit`` whose scheduled switch loses a rank ends on every survivor with ``SwitchFailedError``.

Launcher: ``subprocess.Popen``, one python process per rank (``switch_fault_fit.py``) with
Lightning's own variables set here, so no launcher runs (Lightning's and torchrun's would stop every
rank when one dies). 4 ranks, gloo, megatron on CPU, a real ``Trainer`` with a ``ModelCheckpoint``
saving every step and a ``ScheduledReconfig`` switching dp4-zero1 -> dp1-tp2-pp2 after step 2;
``DYNATRAIN_SWITCH_FAULT`` kills rank 2 (SIGKILL) as it enters the switch's transfer phase.

Every survivor's ``fit`` must end, within the switch timeout of the kill, with ``SwitchFailedError``
naming rank 2 and the transfer phase, saying the state is lost and naming the last checkpoint (step
1's: Lightning runs ``ModelCheckpoint`` after the other callbacks, so step 2's switch comes first);
Lightning's teardown must destroy the process group and the process must exit with the error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist import free_port

SCRIPT = Path(__file__).with_name("switch_fault_fit.py")
ROOT = Path(__file__).resolve().parents[2]
WORLD, VICTIM, SWITCH_TIMEOUT = 4, 2, 20.0
pytestmark = pytest.mark.slow


def test_fit_survivors_end_with_switch_failed(tmp_path: Path) -> None:
    port, procs, limit_s = free_port(), [], 300.0
    start = time.monotonic()
    try:
        for rank in range(WORLD):
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "TORCHELASTIC_",
                                        "SLURM_", "DYNATRAIN_", "OMP_NUM_THREADS"))}
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                       WORLD_SIZE=str(WORLD), DYNATRAIN_SWITCH_FAULT=f"{VICTIM}:transfer:KILL",
                       PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
            log = open(tmp_path / f"rank{rank}.log", "w")
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path),
                                           "--switch-timeout", str(SWITCH_TIMEOUT)],
                                          env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        t_kill = None
        while time.monotonic() - start < limit_s:
            if t_kill is None and procs[VICTIM].poll() is not None:
                t_kill = time.time()
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        else:
            logs = "\n".join(f"--- rank {r}\n" + (tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD))
            raise AssertionError(f"the ranks did not end within {limit_s:.0f} s\n{logs}")
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
        print(f"seconds from the kill to each survivor's SwitchFailedError: {[round(s, 1) for s in seconds]}")
        assert max(seconds) < SWITCH_TIMEOUT + 10, seconds
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
