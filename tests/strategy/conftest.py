"""The one spawned 4-process job of tests/strategy (parity, resume, validation, switching), run once per session."""

from __future__ import annotations

import pytest

from tests.strategy.jobs import run_world4


@pytest.fixture(scope="session")
def world4(tmp_path_factory) -> list[dict]:
    return run_world4(str(tmp_path_factory.mktemp("strategy_world4")))
