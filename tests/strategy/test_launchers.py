"""A 3-step run under each way a user starts processes: Lightning's own launcher, torchrun, SLURM srun
(static), and ``fabric run`` (with a switch).

Each run is real: separate OS processes, a gloo group, megatron on CPU, a Lightning ``Trainer``. They
must agree on the losses (same seed, same global batches), and whatever thread count the launcher
left, no node may run more intra-op threads than it has cores (``runtime/threads.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dynatrain.runtime.threads import available_cores
from tests.dist import fabric_executable, free_port

SCRIPT = Path(__file__).with_name("launch_script.py")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "LOCAL_RANK", "MASTER_", "WORLD_SIZE", "RANK", "GROUP_RANK",
                                "OMP_NUM_THREADS", "DYNATRAIN_NUM_THREADS", "LT_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _results(out: Path, world: int) -> list[dict]:
    files = sorted(out.glob("rank*.json"))
    assert len(files) == world, f"expected {world} rank files, got {[f.name for f in files]}"
    return [json.loads(f.read_text()) for f in files]


def _check(results: list[dict], env: str) -> list[float]:
    for rank, r in enumerate(results):
        assert r["env"] == env
        assert (r["global_rank"], r["world_size"], r["dist_rank"], r["dist_world"]) == (rank, 2, rank, 2)
        assert r["layout"] == "dp2-tp1-pp1" and r["dp"] == 2
        assert r["sampler"] == {"num_replicas": 2, "rank": rank}
        assert r["global_step"] == 3 and len(r["losses"]) == 3
        assert not r["dist_after"], "the strategy destroys the process group it created"
        assert r["threads"] == 1 or 2 * r["threads"] <= available_cores(), f"oversubscribed: {r['threads']} threads"
    assert results[0]["losses"] == results[1]["losses"], "the loss is the same float on every rank"
    return results[0]["losses"]


def _run(cmd: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """Lightning's subprocess launcher (``python train.py`` with devices=2), as for DDP."""
    out = tmp_path_factory.mktemp("lightning_launcher")
    _run([sys.executable, str(SCRIPT), str(out), "--devices", "2"], _env())
    results = _results(out, 2)
    assert results[0]["launcher"] == "_SubprocessScriptLauncher"  # rank 0 started rank 1
    return _check(results, "LightningEnvironment")


def test_lightning_launcher(reference: list[float]) -> None:
    assert reference[-1] < reference[0]


def test_torchrun_with_registry_name(tmp_path: Path, reference: list[float]) -> None:
    """``torchrun --nproc-per-node 2`` and ``Trainer(strategy="dynatrain")`` (layout auto = dp2)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _run([*torchrun, str(SCRIPT), str(tmp_path), "--devices", "2", "--registry-name"], _env(OMP_NUM_THREADS="1"))
    results = _results(tmp_path, 2)
    assert all(r["launcher"] is None for r in results)
    assert _check(results, "TorchElasticEnvironment") == reference


def test_slurm_srun_environment(tmp_path: Path, reference: list[float]) -> None:
    """Processes started as ``srun --ntasks 2`` starts them: ranks come from SLURM's variables.

    SLURM_PROCID is given in reverse order of process start, so a rank taken from start order or
    from any other variable would not match.
    """
    port = str(free_port())
    procs = []
    for procid in (1, 0):
        env = _env(SLURM_NTASKS="2", SLURM_PROCID=str(procid), SLURM_LOCALID=str(procid), SLURM_NODEID="0",
                   SLURM_NNODES="1", SLURM_NTASKS_PER_NODE="2", SLURM_NODELIST="localhost", SLURM_JOB_ID="4242",
                   SLURM_JOB_NAME="dynatrain-test", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), "--devices", "2"], env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-4000:] for o in outputs)
    results = _results(tmp_path, 2)
    assert [r["slurm_procid"] for r in results] == ["0", "1"]
    assert all(r["launcher"] is None for r in results)
    assert _check(results, "SLURMEnvironment") == reference


def test_fabric_run_switches_and_fits_its_threads_to_the_cores(tmp_path: Path, reference: list[float]) -> None:
    """``fabric run --accelerator cpu --devices 2`` with a switch at step 2 (dp2 -> tp2).

    ``fabric run`` sets OMP_NUM_THREADS to all the cores in every process; the strategy lowers each
    process to cores // 2 and rank 0 says so once. Before the switch the losses are the static
    run's, bit for bit; the step after it runs at tp2 (another summation order) and agrees closely.
    """
    cores = available_cores()
    out = _run([fabric_executable(), "run", "--accelerator", "cpu", "--devices", "2", str(SCRIPT), str(tmp_path),
                "--devices", "2", "--schedule", "2:dp1-tp2-pp1"], _env())
    results = _results(tmp_path, 2)
    for rank, r in enumerate(results):
        assert (r["env"], r["launcher"], r["global_rank"], r["world_size"]) == ("TorchElasticEnvironment", None, rank, 2)
        assert r["threads"] == max(1, cores // 2)
        assert r["switches"] == [[2, "dp2-tp1-pp1", "dp1-tp2-pp1"]] and r["final_layout"] == "dp1-tp2-pp1"
        assert not r["dist_after"]
    losses = results[0]["losses"]
    assert results[1]["losses"] == losses
    assert losses[:2] == reference[:2]
    assert losses == pytest.approx(reference, rel=1e-4)
    lowered = f"[dynatrain] 2 processes x {cores} intra-op threads exceed the {cores} cores of this node"
    assert out.count(lowered) == (1 if cores >= 2 else 0), out[-3000:]
