"""``examples/accelerate_gpt.py`` under the real ``accelerate launch`` (4 processes, MULTI_CPU, gloo),
switching layout twice, against the Lightning demo of the same model, data and seed, and resumed
from its own ``accelerator.save_state`` at another starting layout.

Three real jobs, each under its own timeout: the Accelerate run (saves its state after step 3), the
Lightning run (``examples/train_gpt.py``, Lightning's launcher), and an Accelerate run that starts at
the first layout, loads the checkpoint written at the second one and trains steps 4 to 6.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

#: a tiny model and a few steps; the switches change dp, tp, pp and zero
MODEL = ["--hidden", "32", "--layers", "2", "--heads", "4", "--ffn", "64", "--seq-length", "32", "--global-batch", "8",
         "--micro-batch", "1", "--warmup", "2", "--seed", "1234"]
STEPS, START, SCHEDULE, SAVE_AT = 6, "dp2-tp2-pp1", "2:dp1-tp2-pp2,4:dp2-tp1-pp2-zero1", 3
LAYOUT_OF_STEP = {1: START, 2: START, 3: "dp1-tp2-pp2", 4: "dp1-tp2-pp2", 5: "dp2-tp1-pp2-zero1", 6: "dp2-tp1-pp2-zero1"}
TIMEOUT_S = 300


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "LOCAL_RANK", "MASTER_", "WORLD_SIZE", "RANK", "GROUP_RANK",
                                "ACCELERATE_", "DYNATRAIN_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HOME"] = str(tmp / "hf")  # no user-wide `accelerate config` file: the flags below say everything
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], tmp: Path, **env: str) -> str:
    proc = subprocess.run(cmd, env={**_env(tmp), **env}, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc.stdout


def _accelerate(out: Path, *extra: str, **env: str) -> str:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "4",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port())]
    return _run([*launch, "examples/accelerate_gpt.py", "--max-steps", str(STEPS), "--layout", START, "--schedule",
                 SCHEDULE, *MODEL, "--out", str(out), *extra], out.parent, **env)


def _metrics(out: Path) -> list[tuple[int, float, str]]:
    with open(out / "metrics.csv", newline="") as f:
        return [(int(r["step"]), float(r["loss"]), r["layout"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("accelerate_example")
    accel = _accelerate(tmp / "accelerate", "--save-state-at", str(SAVE_AT))
    lightning = _run([sys.executable, "examples/train_gpt.py", "--devices", "4", "--max-steps", str(STEPS), "--layout",
                      START, "--schedule", SCHEDULE, *MODEL, "--out", str(tmp / "lightning")], tmp)
    # the resumed run's switches hold the old state until every rank has its new one (the plugin
    # reads its fault settings from the environment, as the strategy takes them as arguments)
    # (and builds its switches on demand, where the straight run builds each ahead)
    resumed = _accelerate(tmp / "resumed", "--resume", str(tmp / "accelerate" / "state"),
                          DYNATRAIN_SWITCH_SAFETY="keep_old", DYNATRAIN_SWITCH_TIMEOUT="120",
                          DYNATRAIN_SCHEDULE_AHEAD="false")
    return dict(tmp=tmp, accel=accel, lightning=lightning, resumed=resumed)


def test_accelerate_launch_trains_and_switches_like_the_lightning_run(runs: dict) -> None:
    accel, lightning = _metrics(runs["tmp"] / "accelerate"), _metrics(runs["tmp"] / "lightning")
    assert [(step, layout) for step, _, layout in accel] == sorted(LAYOUT_OF_STEP.items())
    assert [(step, layout) for step, _, layout in lightning] == sorted(LAYOUT_OF_STEP.items())
    assert [loss for _, loss, _ in accel] == pytest.approx([loss for _, loss, _ in lightning], rel=1e-4)
    assert accel[-1][1] < accel[0][1]
    out = runs["accel"]
    assert "4 processes (gloo, DistributedType.MULTI_CPU)" in out
    switches = [line for line in out.splitlines() if line.startswith("[dynatrain] step ")]
    assert [line.split(" in ")[0] for line in switches] == [
        "[dynatrain] step 2: dp2-tp2-pp1 -> dp1-tp2-pp2", "[dynatrain] step 4: dp1-tp2-pp2 -> dp2-tp1-pp2-zero1"]
    assert all("built ahead in" in line for line in switches), switches  # the plugin's schedule_ahead default
    assert "2 switches, losses identical on every process" in out
    assert len((runs["tmp"] / "accelerate" / "switches.jsonl").read_text().splitlines()) == 2


def test_save_state_writes_every_ranks_shard_and_load_state_resumes_at_another_starting_layout(runs: dict) -> None:
    state = runs["tmp"] / "accelerate" / "state"
    assert sorted(p.name for p in (state / "dynatrain").iterdir()) == [
        "layout.json", "rank00000.pt", "rank00001.pt", "rank00002.pt", "rank00003.pt"]
    assert not (state / "model.safetensors").exists(), "Accelerate must not write rank 0's shard as the model"
    assert {"optimizer.bin", "custom_checkpoint_0.pkl", "random_states_3.pkl"} <= {p.name for p in state.iterdir()}
    out = runs["resumed"]
    assert "was written at dp1-tp2-pp2 (step 3); switching from dp2-tp2-pp1" in out
    assert f"resumed from {state} at step 3, dp1-tp2-pp2" in out
    resumed, straight = _metrics(runs["tmp"] / "resumed"), _metrics(runs["tmp"] / "accelerate")
    assert [(step, layout) for step, _, layout in resumed] == [(s, LAYOUT_OF_STEP[s]) for s in (4, 5, 6)]
    assert [loss for _, loss, _ in resumed] == pytest.approx([loss for _, loss, _ in straight[SAVE_AT:]], rel=1e-6)
    step4 = next(line for line in out.splitlines() if line.startswith("[dynatrain] step 4: dp1-tp2-pp2 -> dp2-tp1-pp2-zero1"))
    assert "built ahead" not in step4, step4  # DYNATRAIN_SCHEDULE_AHEAD=false
    assert "switch_timeout 120 s, switch_safety keep_old, switches built on demand)" in out
