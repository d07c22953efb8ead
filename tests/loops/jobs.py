"""What the loop examples' tests share: one tiny model and schedule, and how a job is run."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: a tiny model and a few steps; the switches change dp, tp, pp, zero and the virtual stages (one layer
#: in each of two model chunks per pipeline stage)
MODEL = ["--hidden", "32", "--layers", "4", "--heads", "4", "--ffn", "64", "--seq-length", "32", "--global-batch", "8",
         "--micro-batch", "1", "--warmup", "2", "--seed", "1234"]
STEPS, START, SCHEDULE, SAVE_AT = 6, "dp2-tp2-pp1", "2:dp1-tp2-pp2,4:dp2-tp1-pp2-vpp2-zero1", 3
LAYOUT_OF_STEP = {1: START, 2: START, 3: "dp1-tp2-pp2", 4: "dp1-tp2-pp2", 5: "dp2-tp1-pp2-vpp2-zero1",
                  6: "dp2-tp1-pp2-vpp2-zero1"}
TIMEOUT_S = 300
#: validation on the project's own sources (held out: the model trains on the stdlib), at steps 0, 3 and 6
VALIDATE = ["--val-root", "lightning_dynatrain", "--val-every", "3", "--val-batches", "1"]


def job_env(tmp: Path) -> dict[str, str]:
    """This environment without any launcher's or the project's variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "LOCAL_RANK", "MASTER_", "WORLD_SIZE", "RANK", "GROUP_RANK",
                                "ACCELERATE_", "DYNATRAIN_", "LT_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HOME"] = str(tmp / "hf")  # no user-wide `accelerate config` file: the flags say everything
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_job(cmd: list[str], tmp: Path, **env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root under ``TIMEOUT_S``; it must exit 0."""
    proc = subprocess.run(cmd, env={**job_env(tmp), **env}, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def metrics(out: Path, name: str = "metrics.csv") -> list[tuple[int, float, str]]:
    """A run's ``metrics.csv`` (or ``val.csv``): (step, loss, layout) rows."""
    with open(out / name, newline="") as f:
        return [(int(r["step"]), float(r.get("loss") or r["val_loss"]), r["layout"]) for r in csv.DictReader(f)]
