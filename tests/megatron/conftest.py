"""Session-wide spawned Megatron jobs (one per world size), shared by every test module here."""

from __future__ import annotations

import pytest

from tests.megatron.jobs import WORLD1, WORLD2, WORLD4, run_job


@pytest.fixture(scope="session")
def world1() -> list[dict]:
    return run_job(1, WORLD1)


@pytest.fixture(scope="session")
def world2() -> list[dict]:
    return run_job(2, WORLD2)


@pytest.fixture(scope="session")
def world4() -> list[dict]:
    return run_job(4, WORLD4)


@pytest.fixture
def job(request):
    """``job(world_size)`` -> the per-rank results of that world size's job (run once per session)."""
    return lambda world_size: request.getfixturevalue(f"world{world_size}")
