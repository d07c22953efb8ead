"""The engine on NCCL with state on the GPU (skipped without CUDA).

World 1 needs one GPU (local copies only: grid -> zero1 shards and back, device detection, the
preflight all-reduce on the device). World 2 needs two GPUs, or ``DYNATRAIN_SHARE_GPU=1`` to put both
ranks on one GPU where the installed NCCL allows it.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_dynatrain.vps.spec import Precision
from tests.transition.cases import Case
from tests.dist import run_distributed
from tests.transition.jobs import run_cases
from tests.transition.test_switch_dist import DENSE, GQA, MOE, WIDE, WIDE_MOE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16, FP32 = Precision.BF16, Precision.FP32

WORLD1 = [Case(DENSE, "dp1", "dp1-zero1", BF16), Case(MOE, "dp1-zero1", "dp1", FP32, budget=256)]
WORLD2 = [
    Case(DENSE, "dp2", "tp2-zero1", BF16),
    Case(WIDE, "dp2-zero1", "pp2", BF16, budget=512),
    Case(GQA, "tp2", "dp2-zero1", FP32, budget=160),
    Case(MOE, "dp2-ep2-zero1", "tp2", BF16),
    Case(WIDE_MOE, "dp1", "dp2-ep2-zero1", FP32),
]


def _check(reports: list[list[dict]]) -> None:
    for rows in zip(*reports):
        assert all(r["peak"] <= r["budget"] for r in rows)
        assert sum(r["sent"] for r in rows) == sum(r["recv"] for r in rows)


def test_world1_local_copies_on_gpu():
    _check(run_distributed(run_cases, 1, WORLD1, "cuda", backend="nccl", timeout_s=180))


@pytest.mark.skipif(torch.cuda.device_count() < 2 and os.environ.get("DYNATRAIN_SHARE_GPU") != "1",
                    reason="needs two GPUs (or DYNATRAIN_SHARE_GPU=1)")
def test_world2_switches_on_gpu():
    _check(run_distributed(run_cases, 2, WORLD2, "cuda", backend="nccl", timeout_s=180))
