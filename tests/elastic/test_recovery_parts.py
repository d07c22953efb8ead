"""The single-process parts of a recovery: what a user gives for in-memory snapshots is checked at
construction; the step log a recovery replays from keeps exactly the steps after the last snapshot,
as copies; a SIGTERM is torchrun stopping a launch that lost a worker only when it is."""

from __future__ import annotations

import pytest
import torch

from lightning_dynatrain import OnNodeChange
from lightning_dynatrain.elastic.driver.step_log import StepLog


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_a_snapshot_interval_that_is_not_a_step_count_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match="snapshot_every"):
        OnNodeChange({2: "dp2-tp1-pp1"}, snapshot_every=bad)


@pytest.mark.parametrize("bad", [0, 3, True, "2"])
def test_a_snapshot_buffer_count_other_than_one_or_two_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match="snapshot_buffers"):
        OnNodeChange({2: "dp2-tp1-pp1"}, snapshot_every=3, snapshot_buffers=bad)


def test_the_step_log_keeps_copies_of_the_steps_after_the_snapshot():
    """The loader hands every step the same buffer, refilled in place: a log that kept a reference
    would replay the last batch written (here step 5's, then +100) for every step."""
    log = StepLog()
    base = torch.arange(8).view(2, 4)
    tokens = torch.empty_like(base)  # the loader's one buffer
    for step in range(1, 6):
        tokens.copy_(base + step)
        log.record(step, {"tokens": tokens}, lr=0.1 * step, weight_decay=0.01)
    tokens += 100  # the loader reusing its buffer changes nothing kept
    log.drop_through(3)  # a snapshot of step 3
    assert log.steps() == (4, 5)
    replay = log.between(4, 5)
    assert [s.step for s in replay] == [4, 5] and [s.lr for s in replay] == pytest.approx([0.4, 0.5])
    assert torch.equal(replay[0].batch["tokens"], base + 4) and torch.equal(replay[1].batch["tokens"], base + 5)
    assert log.nbytes() == 2 * tokens.nbytes
    with pytest.raises(KeyError, match=r"steps \[3\] are not in this rank's step log"):
        log.between(3, 5)


def test_a_sigterm_is_the_launch_going_down_only_under_torchrun_with_a_worker_gone(tmp_path):
    """``launch_torn_down`` reads the agent's children from ``/proc``: fewer alive than the launch
    started means torchrun is stopping the launch (a fake ``/proc`` of the agent's children)."""
    import os

    from lightning_dynatrain.elastic.launch_teardown import launch_torn_down

    agent = os.getppid()

    def child(pid: int, state: str, parent: int = agent) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python -m x) {state} {parent} 1 1 0\n")

    torchrun = {"TORCHELASTIC_RUN_ID": "job", "LOCAL_WORLD_SIZE": "2"}
    child(101, "S")
    child(102, "R")
    child(103, "S", parent=1)  # not the agent's
    assert not launch_torn_down(torchrun, proc=tmp_path)  # both workers alive: SIGTERM is a notice to leave
    (tmp_path / "102" / "stat").write_text(f"102 (python) Z {agent} 1 1 0\n")  # a worker exited
    assert launch_torn_down(torchrun, proc=tmp_path)
    assert not launch_torn_down({"LOCAL_WORLD_SIZE": "2"}, proc=tmp_path)  # srun, or python: always a notice
    assert not launch_torn_down({**torchrun, "LOCAL_WORLD_SIZE": "1"}, proc=tmp_path)
