"""The spawned 4-process jobs of tests/strategy, each run once per session.

``world4`` (``jobs.py``): parity, resume, validation, switching and bf16 with the GPT family on the
stdlib text. ``families4`` (``families_job.py``): MoE and llama-style fits with switches, on
megatron's indexed dataset; returns ``(per-rank results, the corpus's path prefix)``.
"""

from __future__ import annotations

import pytest

from tests.strategy.families_job import run_families4
from tests.strategy.jobs import run_world4


@pytest.fixture(scope="session")
def world4(tmp_path_factory) -> list[dict]:
    return run_world4(str(tmp_path_factory.mktemp("strategy_world4")))


@pytest.fixture(scope="session")
def families4(tmp_path_factory) -> tuple[list[dict], str]:
    return run_families4(str(tmp_path_factory.mktemp("strategy_families4")))
