"""``examples/fabric_gpt.py`` under the real ``fabric run`` (4 processes, torchelastic, gloo), switching
layout twice and validating at every layout, against the Lightning demo of the same model, data and
seed; resumed from its own ``fabric.save`` under Fabric's own launcher (``python ... --devices N``:
``Fabric.launch()`` starts the other processes), at the layout that wrote it (the same losses,
exactly) and on 2 processes; in bf16 (``Fabric(precision="bf16-true")``: megatron's bf16 params with
fp32 main params), saved, sampled at another layout in a rollout phase and resumed (the resumed
run, without the phase, must match it), with a scheduled switch refused in the resumed run (training
goes on; or, in a run of its own, the error leaves the loop); and
with a rank killed in a switch (every survivor fails naming it and the checkpoint to resume from); the
straight run enters a rollout phase after its save (the resumed run, without it, must match it).

Each run is a real job under its own timeout; the Lightning run is the session's (``conftest.py``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import fabric_executable, free_port
from tests.loops.jobs import (
    LAYOUT_OF_STEP,
    MODEL,
    ROOT,
    SAVE_AT,
    SCHEDULE,
    START,
    STEPS,
    VALIDATE,
    job_env,
    metrics,
    run_job,
)

pytestmark = pytest.mark.slow

FABRIC_RUN = [fabric_executable(), "run", "--accelerator", "cpu", "--devices", "4"]
ROLLOUT = "dp4-tp1-pp1"  # the straight run's rollout layout, after step SAVE_AT
BF16_ROLLOUT = "dp1-tp1-pp2"  # the bf16 run's, after step 2 (its training layouts are dp2-tp1-pp1 and dp1-tp2-pp1)


def own_launcher(devices: int) -> list[str]:
    return [sys.executable, "examples/fabric_gpt.py", "--accelerator", "cpu", "--devices", str(devices)]


def _fabric(launch: list[str], out: Path, *extra: str, layout: str = START, schedule: str = SCHEDULE, **env: str):
    script = ["examples/fabric_gpt.py"] if launch is FABRIC_RUN else []
    return run_job([*launch, *script, "--max-steps", str(STEPS), "--layout", layout, "--schedule", schedule, *MODEL,
                    *VALIDATE, "--out", str(out), *extra], out.parent, **env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fabric_example")
    straight = _fabric(FABRIC_RUN, tmp / "fabric", "--save-at", str(SAVE_AT), "--rollout", f"{SAVE_AT}:{ROLLOUT}")
    state = str(tmp / "fabric" / "state")
    resumed = _fabric(own_launcher(4), tmp / "resumed", "--resume", state, layout=LAYOUT_OF_STEP[SAVE_AT],
                      DYNATRAIN_SCHEDULE_AHEAD="false")
    on_two = _fabric(own_launcher(2), tmp / "on_two", "--resume", state, layout="dp1-tp2-pp1", schedule="")
    return dict(tmp=tmp, straight=straight, resumed=resumed, on_two=on_two)


def test_fabric_run_trains_and_switches_like_the_lightning_run(runs: dict, lightning_run: list) -> None:
    fabric = metrics(runs["tmp"] / "fabric")
    assert [(step, layout) for step, _, layout in fabric] == sorted(LAYOUT_OF_STEP.items())
    assert [loss for _, loss, _ in fabric] == pytest.approx([loss for _, loss, _ in lightning_run], rel=1e-4)
    assert fabric[-1][1] < fabric[0][1]
    out = runs["straight"].stdout
    assert "on 4 processes (gloo, Fabric under TorchElasticEnvironment)" in out
    switches = [line for line in out.splitlines() if line.startswith("[dynatrain] step ")]
    assert [line.split(" in ")[0] for line in switches] == [
        "[dynatrain] step 2: dp2-tp2-pp1 -> dp1-tp2-pp2", "[dynatrain] step 4: dp1-tp2-pp2 -> dp2-tp1-pp2-vpp2-zero1"]
    assert all("built ahead in" in line for line in switches), switches
    assert "2 switches, losses identical on every process" in out
    # validation (forward only) at every layout it met, and it did not change training (the losses above)
    assert [(step, layout) for step, _, layout in metrics(runs["tmp"] / "fabric", "val.csv")] == [
        (0, START), (3, LAYOUT_OF_STEP[3]), (6, LAYOUT_OF_STEP[6])]
    # nothing to act on: megatron's import notices and the like are filtered (warning_filters.py)
    assert "Warning" not in runs["straight"].stderr, runs["straight"].stderr[-4000:]


def test_a_rollout_between_two_steps_samples_at_its_layout_and_leaves_training_as_it_was(runs: dict) -> None:
    """The straight run samples at dp4-tp1-pp1 after step 3 (saved just before), with the switch of
    step 4 built ahead (the rollout waits for its build, which stays); the run resumed from that save
    without the rollout computes the same losses after it, bit for bit (the next test): the rollout
    left the training state as it was."""
    out = runs["straight"].stdout
    line = next(x for x in out.splitlines() if x.startswith(f"[fabric_gpt] rollout at {ROLLOUT} after step {SAVE_AT}: "))
    assert "after 'def main('" in line and "mean log-prob -" in line, line


def test_fabric_save_and_load_resume_exactly_at_the_same_layout(runs: dict) -> None:
    state = runs["tmp"] / "fabric" / "state"
    assert sorted(p.name for p in state.iterdir()) == ["dynatrain", "fabric.ckpt"]
    assert (state / "dynatrain" / ".metadata").is_file() and len(list((state / "dynatrain").glob("*.distcp"))) == 4
    out = runs["resumed"].stdout
    assert "on 4 processes (gloo, Fabric under LightningEnvironment)" in out
    assert f"loaded {state} (step 3, written at dp1-tp2-pp2 on 4 processes) into dp1-tp2-pp2 on 4" in out
    assert f"resumed from {state} at step 3, dp1-tp2-pp2" in out
    resumed, straight = metrics(runs["tmp"] / "resumed"), metrics(runs["tmp"] / "fabric")
    assert [(step, layout) for step, _, layout in resumed] == [(s, LAYOUT_OF_STEP[s]) for s in (4, 5, 6)]
    assert [loss for _, loss, _ in resumed] == [loss for _, loss, _ in straight[SAVE_AT:]]  # bit for bit
    assert metrics(runs["tmp"] / "resumed", "val.csv") == metrics(runs["tmp"] / "fabric", "val.csv")[1:]
    step4 = next(line for line in out.splitlines() if line.startswith("[dynatrain] step 4: dp1-tp2-pp2 -> "))
    assert "built ahead" not in step4, step4  # DYNATRAIN_SCHEDULE_AHEAD=false, read by the strategy's plugin


def test_fabric_load_resumes_on_another_number_of_processes(runs: dict) -> None:
    state = runs["tmp"] / "fabric" / "state"
    out = runs["on_two"].stdout
    assert f"loaded {state} (step 3, written at dp1-tp2-pp2 on 4 processes) into dp1-tp2-pp1 on 2" in out
    on_two, straight = metrics(runs["tmp"] / "on_two"), metrics(runs["tmp"] / "fabric")
    assert [(step, layout) for step, _, layout in on_two] == [(4, "dp1-tp2-pp1"), (5, "dp1-tp2-pp1"), (6, "dp1-tp2-pp1")]
    assert [loss for _, loss, _ in on_two] == pytest.approx([loss for _, loss, _ in straight[SAVE_AT:]], rel=1e-4)
    # the same weights give the same validation loss at another layout on another number of processes
    (step, val, layout), *_ = metrics(runs["tmp"] / "on_two", "val.csv")
    straight_val = dict((s, v) for s, v, _ in metrics(runs["tmp"] / "fabric", "val.csv"))
    assert (step, layout) == (3, "dp1-tp2-pp1") and val == pytest.approx(straight_val[3], rel=1e-5)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> dict:
    """Two processes at ``bf16-true``: 4 steps switching at step 2, saved after it and sampling in a
    rollout phase at ``BF16_ROLLOUT`` then; resumed from that save with a switch at step 3 that the memory
    limit refuses (``DYNATRAIN_SWITCH_MEMORY_LIMIT``)."""
    tmp = tmp_path_factory.mktemp("fabric_bf16")
    args = ["--precision", "bf16-true", "--max-steps", "4", *MODEL]
    first = run_job([*own_launcher(2), *args, "--schedule", "2:dp1-tp2-pp1", "--layout", "dp2-tp1-pp1",
                     "--save-at", "2", "--rollout", f"2:{BF16_ROLLOUT}", "--out", str(tmp / "first")], tmp)
    resumed = run_job([*own_launcher(2), *args, "--schedule", "3:dp2-tp1-pp1", "--layout", "dp1-tp2-pp1",
                       "--resume", str(tmp / "first" / "state"), "--out", str(tmp / "resumed")], tmp,
                      DYNATRAIN_SWITCH_MEMORY_LIMIT="1KiB")
    return dict(tmp=tmp, first=first, resumed=resumed)


def test_bf16_true_trains_megatron_bf16_params_switches_and_resumes(bf16: dict) -> None:
    rows = metrics(bf16["tmp"] / "first")
    assert [layout for _, _, layout in rows] == ["dp2-tp1-pp1"] * 2 + ["dp1-tp2-pp1"] * 2
    assert all(4.0 < loss < 6.0 for _, loss, _ in rows), rows
    assert "[dynatrain] step 2: dp2-tp1-pp1 -> dp1-tp2-pp1" in bf16["first"].stdout
    assert "params bfloat16" in bf16["first"].stdout
    assert "written at dp1-tp2-pp1 on 2 processes) into dp1-tp2-pp1 on 2" in bf16["resumed"].stdout
    # a rollout of the bf16 weights at another layout (bf16 there too), weights only, and back
    line = next(x for x in bf16["first"].stdout.splitlines() if x.startswith("[fabric_gpt] rollout at "))
    assert line.startswith(f"[fabric_gpt] rollout at {BF16_ROLLOUT} after step 2: ") and "mean log-prob -" in line, line
    # bf16 params, fp32 main params and moments: bit for bit (neither the rollout nor the refused switch
    # changed anything: the resumed run had no rollout)
    assert metrics(bf16["tmp"] / "resumed") == rows[2:]


def test_a_refused_scheduled_switch_goes_by_and_training_goes_on(bf16: dict, tmp_path: Path) -> None:
    assert "[dynatrain] the switch to dp2-tp1-pp1 at step 3 was refused before anything moved (SwitchMemoryError: " \
           in bf16["resumed"].stdout
    assert "the old state is whole and training goes on at dp1-tp2-pp1" in bf16["resumed"].stdout
    assert [layout for _, _, layout in metrics(bf16["tmp"] / "resumed")] == ["dp1-tp2-pp1"] * 2
    args = [*own_launcher(2), "--max-steps", "3", "--layout", "dp2-tp1-pp1", "--schedule", "2:dp1-tp2-pp1", *MODEL]
    with pytest.raises(AssertionError, match="SwitchMemoryError"):  # run_job asserts exit 0
        run_job([*args, "--out", str(tmp_path / "raise")], tmp_path, DYNATRAIN_SWITCH_MEMORY_LIMIT="1KiB",
                DYNATRAIN_ON_REFUSED="raise")


def test_a_rank_killed_in_a_switch_stops_every_survivor_naming_it_and_the_checkpoint(tmp_path: Path) -> None:
    """Four processes started by hand (Fabric's own launcher and ``fabric run`` stop every process
    when one dies): Fabric sees ``LOCAL_RANK`` and starts none; rank 2 is killed as it enters the
    transfer of the switch at step 2, after ``fabric.save`` at step 1."""
    port = free_port()
    env = {**job_env(tmp_path), "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "DYNATRAIN_SWITCH_FAULT": "2:transfer:KILL", "DYNATRAIN_SWITCH_TIMEOUT": "20"}
    cmd = [*own_launcher(4), "--max-steps", "4", "--layout", START, "--schedule", "2:dp1-tp2-pp2", *MODEL,
           "--save-at", "1", "--out", str(tmp_path / "run")]
    logs = [open(tmp_path / f"rank{rank}.log", "w+") for rank in range(4)]
    procs = [subprocess.Popen(cmd, env={**env, "LOCAL_RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT,
                              cwd=ROOT) for rank, log in enumerate(logs)]
    try:
        codes = [proc.wait(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    assert codes[2] == -9 and all(codes[r] == 1 for r in (0, 1, 3)), codes
    for rank in (0, 1, 3):
        assert "SwitchFailedError: layout switch dp2-tp2-pp1 -> dp1-tp2-pp2 failed: rank 2 stopped answering in " \
               "phase 'transfer'" in texts[rank], texts[rank][-3000:]
        assert f"resume the job from the last checkpoint, {tmp_path / 'run' / 'state'}" in texts[rank]
