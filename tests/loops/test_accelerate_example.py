"""``examples/accelerate_gpt.py`` under the real ``accelerate launch`` (4 processes, MULTI_CPU, gloo),
switching layout twice, against the Lightning demo of the same model, data and seed, and resumed
from its own ``accelerator.save_state`` at another layout.

Three real jobs, each under its own timeout: the Accelerate run (saves its state after step 3), the
Lightning run (``examples/train_gpt.py``, Lightning's launcher; the session's, ``conftest.py``), and
an Accelerate run that starts at the first layout, loads the checkpoint written at the second one
and trains steps 4 to 6.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.dist import free_port
from tests.loops.jobs import LAYOUT_OF_STEP, MODEL, SAVE_AT, SCHEDULE, START, STEPS, VALIDATE, metrics, run_job

pytestmark = pytest.mark.slow


def _accelerate(out: Path, *extra: str, **env: str) -> str:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "4",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port())]
    return run_job([*launch, "examples/accelerate_gpt.py", "--max-steps", str(STEPS), "--layout", START, "--schedule",
                    SCHEDULE, *MODEL, "--out", str(out), *extra], out.parent, **env).stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("accelerate_example")
    accel = _accelerate(tmp / "accelerate", "--save-state-at", str(SAVE_AT), *VALIDATE)
    # the resumed run's switches hold the old state until every rank has its new one (the plugin
    # reads its fault settings from the environment, as the strategy takes them as arguments)
    # (and builds its switches on demand, where the straight run builds each ahead)
    resumed = _accelerate(tmp / "resumed", "--resume", str(tmp / "accelerate" / "state"),
                          DYNATRAIN_SWITCH_SAFETY="keep_old", DYNATRAIN_SWITCH_TIMEOUT="120",
                          DYNATRAIN_SCHEDULE_AHEAD="false")
    return dict(tmp=tmp, accel=accel, resumed=resumed)


def test_accelerate_launch_trains_and_switches_like_the_lightning_run(runs: dict, lightning_run: list) -> None:
    accel, lightning = metrics(runs["tmp"] / "accelerate"), lightning_run
    assert [(step, layout) for step, _, layout in accel] == sorted(LAYOUT_OF_STEP.items())
    assert [(step, layout) for step, _, layout in lightning] == sorted(LAYOUT_OF_STEP.items())
    assert [loss for _, loss, _ in accel] == pytest.approx([loss for _, loss, _ in lightning], rel=1e-4)
    assert accel[-1][1] < accel[0][1]
    out = runs["accel"]
    assert "4 processes (gloo, DistributedType.MULTI_CPU)" in out
    switches = [line for line in out.splitlines() if line.startswith("[dynatrain] step ")]
    assert [line.split(" in ")[0] for line in switches] == [
        "[dynatrain] step 2: dp2-tp2-pp1 -> dp1-tp2-pp2", "[dynatrain] step 4: dp1-tp2-pp2 -> dp2-tp1-pp2-vpp2-zero1"]
    assert all("built ahead in" in line for line in switches), switches  # the plugin's schedule_ahead default
    assert "2 switches, losses identical on every process" in out
    assert len((runs["tmp"] / "accelerate" / "switches.jsonl").read_text().splitlines()) == 2
    # validation (model.eval(): forward only) at every layout it met, and it did not change training
    assert [(step, layout) for step, _, layout in metrics(runs["tmp"] / "accelerate", "val.csv")] == [
        (0, START), (3, LAYOUT_OF_STEP[3]), (6, LAYOUT_OF_STEP[6])]


def test_save_state_writes_a_layout_free_checkpoint_and_load_state_resumes_at_another_layout(runs: dict) -> None:
    state = runs["tmp"] / "accelerate" / "state"
    assert (state / "dynatrain" / ".metadata").is_file()  # DCP: every piece of state under its logical key
    assert len(list((state / "dynatrain").glob("*.distcp"))) == 4
    assert not (state / "model.safetensors").exists(), "Accelerate must not write rank 0's shard as the model"
    assert {"optimizer.bin", "custom_checkpoint_0.pkl", "random_states_3.pkl"} <= {p.name for p in state.iterdir()}
    out = runs["resumed"]
    assert f"loaded {state} (step 3, written at dp1-tp2-pp2 on 4 processes) into dp2-tp2-pp1 on 4" in out
    assert f"resumed from {state} at step 3, dp2-tp2-pp1" in out
    resumed, straight = metrics(runs["tmp"] / "resumed"), metrics(runs["tmp"] / "accelerate")
    # step 4 at the resumed run's own layout, then the schedule's entry at step 4
    assert [(step, layout) for step, _, layout in resumed] == [(4, START), (5, LAYOUT_OF_STEP[5]), (6, LAYOUT_OF_STEP[6])]
    assert [loss for _, loss, _ in resumed] == pytest.approx([loss for _, loss, _ in straight[SAVE_AT:]], rel=1e-4)
    step4 = next(line for line in out.splitlines()
                 if line.startswith(f"[dynatrain] step 4: {START} -> dp2-tp1-pp2-vpp2-zero1"))
    assert "built ahead" not in step4, step4  # DYNATRAIN_SCHEDULE_AHEAD=false
    assert "switch_timeout 120 s, switch_safety keep_old, switches built on demand)" in out
