"""The multi-process helper itself: results come back, child failures and hangs fail the test."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist import DistributedTestError, run_distributed


def _sum_ranks(rank: int, world_size: int, scale: float) -> float:
    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 says no")
    dist.barrier()  # rank 0 waits for a peer that never comes


def _hang(rank: int, world_size: int, pids: str) -> None:
    """Say who it is, then hang far longer than any test waits (a hang is what the test is about)."""
    import os
    from pathlib import Path

    Path(pids, str(rank)).write_text(str(os.getpid()))
    time.sleep(3600)


def test_returns_per_rank_values():
    assert run_distributed(_sum_ranks, 2, 1.5) == [4.5, 4.5]


def test_child_exception_text_reaches_the_parent():
    with pytest.raises(DistributedTestError, match="ValueError: rank 1 says no"):
        run_distributed(_fail_on_rank_1, 2, timeout_s=60)


def _alive(pid: int) -> bool:
    """The process runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hang_fails_at_the_timeout_and_its_processes_are_ended(tmp_path):
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(_hang, 2, str(tmp_path), timeout_s=5)
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids), pids  # both hanging children were ended
