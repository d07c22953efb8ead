"""The spawned 4-process jobs of tests/strategy, each run once per session.

``world4`` (``jobs.py``): parity, resume, validation, switching and bf16 with the GPT family on the
stdlib text. ``families4`` (``families_job.py``): MoE and llama-style fits with switches, on
megatron's indexed dataset; returns ``(per-rank results, the corpus's path prefix)``.
``checkpoint4`` and ``checkpoint_world2`` (``checkpoint_job.py``): layout-free checkpoints saved and
resumed at other layouts and world sizes, megatron checkpoints, ``ModelCheckpoint``.
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


@pytest.fixture(scope="session")
def checkpoint4(tmp_path_factory) -> list[dict]:
    """``checkpoint_job.run_checkpoint4``: saves, resumes at other layouts, megatron, ModelCheckpoint."""
    from tests.strategy.checkpoint_job import run_checkpoint4

    return run_checkpoint4(str(tmp_path_factory.mktemp("strategy_checkpoint4")))


@pytest.fixture(scope="session")
def checkpoint_world2(checkpoint4: list[dict]) -> list[dict]:
    """``checkpoint_job.run_checkpoint2``: the checkpoint ``checkpoint4`` saved at world 4, resumed at world 2."""
    from tests.strategy.checkpoint_job import run_checkpoint2

    return run_checkpoint2(checkpoint4[0]["path"])
