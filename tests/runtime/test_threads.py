"""The intra-op thread rule (``runtime/threads.py``) without processes: when it lowers, what it says, and
what counts as the user's explicit choice."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_dynatrain.runtime.threads import ENV, ThreadCountError, decide_threads, fit_intra_op_threads


def test_fabric_run_on_two_cores_is_lowered_to_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fabric run --devices 4`` on 2 cores: OMP_NUM_THREADS=2 in each of 4 processes."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    d = decide_threads(current=2, local_processes=4, cores=2, explicit=None)
    assert (d.threads, d.before, d.reason) == (1, 2, "lowered")
    assert d.message is not None and "4 processes x 2 intra-op threads exceed the 2 cores" in d.message
    assert "OMP_NUM_THREADS=2" in d.message and ENV in d.message


@pytest.mark.parametrize(("current", "processes", "cores", "threads"), [
    (8, 4, 16, 4),   # oversubscribed 2x: cores // processes
    (16, 2, 16, 8),
    (4, 4, 16, 4),   # fits: untouched
    (1, 4, 2, 1),    # more processes than cores, already 1: nothing to lower, nothing to say
    (3, 1, 2, 2),
])
def test_threads_drop_to_cores_per_process_only_when_oversubscribed(current: int, processes: int, cores: int,
                                                                    threads: int) -> None:
    d = decide_threads(current=current, local_processes=processes, cores=cores, explicit=None)
    assert d.threads == threads
    assert (d.message is not None) == (threads < current)


def test_explicit_count_is_kept_even_when_it_oversubscribes() -> None:
    d = decide_threads(current=1, local_processes=4, cores=2, explicit="3")
    assert (d.threads, d.reason, d.message) == (3, "explicit", None)


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_explicit_count_is_a_typed_error(value: str) -> None:
    with pytest.raises(ThreadCountError, match=f"{ENV}=.* is not a positive whole number.*HINT"):
        decide_threads(current=2, local_processes=4, cores=2, explicit=value)


def test_fit_applies_the_decision_and_is_silent_the_second_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second fit in the same process (a second ``Trainer.fit``) finds the count lowered: no second line."""
    before = torch.get_num_threads()
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    monkeypatch.setattr("lightning_dynatrain.runtime.threads.available_cores", lambda: 2)
    try:
        torch.set_num_threads(2)
        first = fit_intra_op_threads(local_processes=4)
        assert (first.reason, torch.get_num_threads()) == ("lowered", 1)
        assert first.message is not None
        assert os.environ["OMP_NUM_THREADS"] == "1"
        second = fit_intra_op_threads(local_processes=4)
        assert (second.reason, second.message) == ("fits", None)
        monkeypatch.setenv(ENV, "2")
        assert fit_intra_op_threads(local_processes=4).threads == torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
