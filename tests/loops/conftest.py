"""The Lightning demo's run of the loop examples' model and schedule (``examples/train_gpt.py``,
Lightning's launcher), run once for the session and compared with the Accelerate and Fabric runs."""

from __future__ import annotations

import sys

import pytest

from tests.loops.jobs import MODEL, SCHEDULE, START, STEPS, metrics, run_job


@pytest.fixture(scope="session")
def lightning_run(tmp_path_factory) -> list[tuple[int, float, str]]:
    """The Lightning demo's metrics for ``MODEL``, ``START`` and ``SCHEDULE`` over ``STEPS`` steps."""
    tmp = tmp_path_factory.mktemp("lightning_reference")
    run_job([sys.executable, "examples/train_gpt.py", "--devices", "4", "--max-steps", str(STEPS), "--layout", START,
             "--schedule", SCHEDULE, *MODEL, "--out", str(tmp / "lightning")], tmp)
    return metrics(tmp / "lightning")
