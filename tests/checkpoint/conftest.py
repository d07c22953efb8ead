"""The spawned 2-process job of tests/checkpoint (``jobs.run_checkpoint2``), run once per session."""

from __future__ import annotations

import pytest

from tests.checkpoint.jobs import run_checkpoint2


@pytest.fixture(scope="session")
def checkpoint2(tmp_path_factory) -> list[dict]:
    return run_checkpoint2(str(tmp_path_factory.mktemp("checkpoint2")))
