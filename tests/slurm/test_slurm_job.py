"""The training demo as a real SLURM batch job: ``sbatch`` a script that ``srun``s 4 tasks on a one-node cluster.

``tests/slurm/cluster.sh`` starts munged, slurmctld and slurmd in a temporary directory (own config,
free ports, own munge key) for this module and stops them afterwards. Unlike
``tests/strategy/test_launchers.py::test_slurm_srun_environment``, which sets SLURM's variables by
hand, here slurmd sets them: the job must be picked up by Lightning's ``SLURMEnvironment``, train 10
steps at ``dp2-tp2-pp1`` and switch once to ``dp4-tp1-pp1`` at step 5.

An elastic fit under SLURM: ``dynatrain store`` on this machine, a first batch job whose ``srun``
starts 2 tasks, a second job of 2 tasks that joins the running fit, then cancelled with SIGTERM
(a preemption notice): its tasks hand their state off and exit 0; a third job that joins and is
killed (SIGKILL: no notice): the first job's tasks recover from their replicas, go on and finish.

The module is skipped only when slurm-wlm and munge are missing and cannot be installed.
"""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.stop_in_store import STOP_KEY
from benchmarks.elastic_job import SCRIPT, ElasticJob

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = Path(__file__).with_name("cluster.sh")
EXIT_INSTALL = 3  # cluster.sh install: the packages are missing and cannot be installed
JOB_TIMEOUT_S = 240
MAX_STEPS = 150  # the elastic job's: room for two joins, a leave and a kill at 0.25 s a step
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
               "BOOT_FAIL", "DEADLINE"}
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything of an enclosing SLURM job or another launcher."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "TORCHELASTIC_", "LOCAL_RANK", "MASTER_",
                                "WORLD_SIZE", "RANK", "GROUP_RANK", "PL_"))}
    env.update(extra)
    return env


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({e})"


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = _clean_env(SLURM_CONF=str(root / "slurm.conf"))

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        """The tails of the daemons' logs, for a failure message."""
        return "\n".join(f"--- {name} (tail)\n{_tail(self.root / 'log' / name)}"
                         for name in ("slurmctld.log", "slurmd.log", "munged.out"))


def _cluster_sh(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout,
                          env=_clean_env())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    inst = _cluster_sh("install", timeout=900)
    if inst.returncode == EXIT_INSTALL:
        pytest.skip(f"no SLURM: slurm-wlm/munge are missing and cannot be installed: {inst.stderr.strip()[-500:]}")
    assert inst.returncode == 0, f"cluster.sh install failed ({inst.returncode}):\n{inst.stdout[-2000:]}\n{inst.stderr[-2000:]}"
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        start = _cluster_sh("start", str(c.root), timeout=120)
        assert start.returncode == 0, (f"cluster.sh start failed ({start.returncode}):\n{start.stdout[-2000:]}\n"
                                       f"{start.stderr[-6000:]}\n{c.logs()}")
        yield c
    finally:
        stop = _cluster_sh("stop", str(c.root), timeout=120)
        assert stop.returncode == 0, f"cluster.sh stop failed ({stop.returncode}):\n{stop.stderr[-2000:]}"


def _wait(cluster: Cluster, job_id: str) -> dict[str, str]:
    """``scontrol show job`` fields once the job is in a final state; scancel and fail after the timeout."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        show = cluster.run("scontrol", "show", "job", "--oneliner", job_id)
        if show.returncode == 0:
            fields = dict(kv.split("=", 1) for kv in show.stdout.split() if "=" in kv)
            if fields.get("JobState") in DONE_STATES:
                return fields
        time.sleep(1.0)
    cluster.run("scancel", job_id)
    return {**fields, "JobState": f"still {fields.get('JobState')} after {JOB_TIMEOUT_S} s (cancelled)"}


def test_srun_demo_switches_once_under_slurm(cluster: Cluster, tmp_path: Path) -> None:
    out, job_out = tmp_path / "out", tmp_path / "job.out"
    venv_python = ROOT / ".venv" / "bin" / "python"  # by its absolute path, not resolved (that leaves the venv)
    python = venv_python if venv_python.exists() else Path(sys.executable).absolute()
    demo = (f"srun -n 4 --ntasks-per-node 4 --oversubscribe {python} examples/train_gpt.py --devices 4 "
            f"--max-steps 10 --layout dp2-tp2-pp1 --schedule 5:dp4-tp1-pp1 --out {out}")
    script = tmp_path / "job.sh"
    # Everything the job needs is set here. MASTER_PORT: Lightning would take 15000 + the job id, the
    # same port for every fresh cluster's first job, so parallel runs would collide.
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=dynatrain-slurm-test
#SBATCH --nodes=1
#SBATCH --ntasks=4
#SBATCH --ntasks-per-node=4
#SBATCH --oversubscribe
#SBATCH --time=10
#SBATCH --output={job_out}
set -euo pipefail
cd {ROOT}
export SLURM_CONF={cluster.root / 'slurm.conf'}
export PYTHONPATH={ROOT}
export OMP_NUM_THREADS=1
export MASTER_PORT={_free_port()}
echo "[job] $SLURM_JOB_ID on $SLURM_JOB_NODELIST, $SLURM_NTASKS tasks"
{demo}
""")
    started = time.monotonic()
    sub = cluster.run("sbatch", "--parsable", str(script))
    assert sub.returncode == 0, f"sbatch failed:\n{sub.stdout}\n{sub.stderr}\n{cluster.logs()}"
    job_id = sub.stdout.strip().split(";")[0]
    job = _wait(cluster, job_id)
    seconds = time.monotonic() - started

    output = job_out.read_text(errors="replace") if job_out.exists() else ""

    def why(msg: str) -> str:
        tail = "\n".join(output.splitlines()[-60:])
        return (f"{msg}\njob {job_id}: JobState={job.get('JobState')} ExitCode={job.get('ExitCode')} "
                f"Reason={job.get('Reason')} after {seconds:.0f} s\n--- {job_out.name} (tail)\n{tail}\n{cluster.logs()}")

    assert job.get("JobState") == "COMPLETED" and job.get("ExitCode") == "0:0", why("the job did not succeed")

    # Rank 0 alone logs the layout line, so exactly one of it also says the ranks came from SLURM_PROCID.
    layout_line = "[dynatrain] layout dp2-tp2-pp1 on 4 processes (gloo, SLURMEnvironment)"
    assert output.count(layout_line) == 1, why(f"expected exactly one line {layout_line!r}")

    switches_file, metrics_file = out / "switches.jsonl", out / "metrics.csv"
    assert switches_file.exists() and metrics_file.exists(), why(f"missing outputs: {sorted(os.listdir(tmp_path))}")
    switches = [json.loads(line) for line in switches_file.read_text().splitlines() if line.strip()]
    assert [(s["step"], s["src"], s["dst"]) for s in switches] == [(5, "dp2-tp2-pp1", "dp4-tp1-pp1")], \
        why(f"switches.jsonl: {switches}")

    with open(metrics_file, newline="") as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["loss"]) for r in rows]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses), why(f"metrics.csv: {rows}")
    assert [r["layout"] for r in rows] == ["dp2-tp2-pp1"] * 5 + ["dp4-tp1-pp1"] * 5, why(f"metrics.csv: {rows}")


def _python() -> Path:
    venv_python = ROOT / ".venv" / "bin" / "python"  # by its absolute path, not resolved (that leaves the venv)
    return venv_python if venv_python.exists() else Path(sys.executable).absolute()


def _sbatch_elastic(cluster: Cluster, job: ElasticJob, tmp_path: Path, name: str, tasks: int) -> str:
    """A batch job whose ``srun`` starts ``tasks`` processes of the elastic fit; its id."""
    job_out = tmp_path / f"{name}.out"
    script = tmp_path / f"{name}.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=dynatrain-{name}
#SBATCH --nodes=1
#SBATCH --ntasks={tasks}
#SBATCH --ntasks-per-node={tasks}
#SBATCH --oversubscribe
#SBATCH --time=10
#SBATCH --output={job_out}
set -euo pipefail
cd {ROOT}
export SLURM_CONF={cluster.root / 'slurm.conf'}
export PYTHONPATH={ROOT} OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export DYNATRAIN_STORE={job.env["DYNATRAIN_STORE"]} DYNATRAIN_TOKEN={job.env["DYNATRAIN_TOKEN"]}
srun -n {tasks} --ntasks-per-node {tasks} --oversubscribe {_python()} {SCRIPT} {job.out} --max-steps {job.max_steps} \\
    --step-seconds {job.step_seconds} --stop-in-store
""")
    sub = cluster.run("sbatch", "--parsable", str(script))
    assert sub.returncode == 0, f"sbatch failed:\n{sub.stdout}\n{sub.stderr}\n{cluster.logs()}"
    return sub.stdout.strip().split(";")[0]


def test_an_elastic_fit_grows_with_a_second_slurm_job_and_shrinks_when_it_is_cancelled(cluster: Cluster,
                                                                                       tmp_path: Path) -> None:
    """... then a third job joins and is killed (``scancel --signal=KILL``: its tasks die without
    leaving, as on a node lost): the first job's tasks recover from their replicas and finish."""
    with ElasticJob(tmp_path / "elastic", max_steps=MAX_STEPS, step_seconds=0.25, dead_after=10.0,
                    suspect_after=2.0) as job:
        first = _sbatch_elastic(cluster, job, tmp_path, "first", 2)
        job.wait_for(lambda: job.step() >= 3, what="the first job to train", timeout=JOB_TIMEOUT_S)
        second = _sbatch_elastic(cluster, job, tmp_path, "second", 2)
        job.wait_for(lambda: job.installed_size() == 4, what="the second job's tasks to join", timeout=JOB_TIMEOUT_S)
        assert cluster.run("scancel", "--signal=TERM", second).returncode == 0  # a preemption notice
        job.wait_for(lambda: job.installed_size() == 2, what="the second job's tasks to leave", timeout=JOB_TIMEOUT_S)
        third = _sbatch_elastic(cluster, job, tmp_path, "third", 2)
        job.wait_for(lambda: job.installed_size() == 4, what="the third job's tasks to join", timeout=JOB_TIMEOUT_S)
        at = job.step()
        job.wait_for(lambda: job.step() >= at + 3, what="world 4 to train", timeout=JOB_TIMEOUT_S)
        assert cluster.run("scancel", "--signal=KILL", third).returncode == 0  # no notice: the tasks die
        job.wait_for(lambda: job.installed_size() == 2, what="the first job's tasks to recover", timeout=JOB_TIMEOUT_S)
        stop = job.step() + 8  # a few steps of the survivors' world, then the fit ends (every rank at that step)
        assert stop < MAX_STEPS, "the kill came after the end: raise MAX_STEPS"
        job.client.store.set(STOP_KEY, str(stop))
        states = {name: _wait(cluster, job_id) for name, job_id in (("first", first), ("second", second),
                                                                    ("third", third))}
        results, log = job.results(), job.tail()
        outputs = {name: _tail(tmp_path / f"{name}.out", 60) for name in states}

    def why(msg: str) -> str:
        return f"{msg}\n{states}\n" + "\n".join(f"--- {n}.out\n{o}" for n, o in outputs.items()) + f"\n--- store\n{log}"

    for name in ("first", "second"):  # the leavers exit 0 too: both jobs complete
        assert (states[name].get("JobState"), states[name].get("ExitCode")) == ("COMPLETED", "0:0"), why(f"job {name}")
    assert states["third"].get("JobState") != "COMPLETED", why("the killed job")
    survivors = [r for r in results.values() if not r["left"]]
    left = [r for r in results.values() if r["left"]]
    assert len(survivors) == 2 and len(left) == 2, why(f"{len(survivors)} survivors, {len(left)} left")
    assert {r["global_step"] for r in survivors} == {stop} and {r["world"] for r in survivors} == {2}, \
        why("the end")
    changes = [(c["change"].split(" (")[0], c["src"], c["dst"]) for c in survivors[0]["changes"]]
    assert changes == [("world 2 -> 4", "dp2-tp1-pp1", "dp2-tp2-pp1"), ("world 4 -> 2", "dp2-tp2-pp1", "dp2-tp1-pp1"),
                       ("world 2 -> 4", "dp2-tp1-pp1", "dp2-tp2-pp1")], why(f"changes: {changes}")
    assert all(c["ahead_build_seconds"] is not None for c in survivors[0]["changes"]), why("built on demand")
    # the second job's tasks leaving gives the first world back: its groups were kept, none was built
    assert [c["kept_world"] for c in survivors[0]["changes"]][:2] == [False, True], why("the first world was not kept")
    for r in survivors:  # the third job's two tasks named, in one recovery or two; nothing redone
        assert sum(len(x["failed"]) for x in r["recoveries"]) == 2, why(f"recoveries: {r['recoveries']}")
        assert {(x["src"], x["dst"], x["steps_redone"]) for x in r["recoveries"]} <= \
            {("dp2-tp2-pp1", "dp2-tp1-pp1", 0), ("dp2-tp2-pp1", "dp3-tp1-pp1", 0), ("dp3-tp1-pp1", "dp2-tp1-pp1", 0)}, \
            why(f"recoveries: {r['recoveries']}")
    losses = [dict(r["losses"]) for r in results.values()]
    for step in range(1, stop + 1):  # every process that ran a step saw the same loss
        seen = {round(l[step], 6) for l in losses if step in l}
        assert len(seen) == 1, why(f"step {step}: losses {seen}")
