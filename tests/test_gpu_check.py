"""``scripts/gpu_check.sh`` on this machine: without CUDA it runs the CPU parts (a bf16 model, its
steps, two world-1 switches fingerprinted bit for bit) and skips each device check with its reason."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script checks the device itself")
def test_gpu_check_runs_its_cpu_part_and_names_what_it_skipped() -> None:
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    verdicts = {row["check"]: (row["verdict"], row["detail"]) for row in result["checks"]}
    assert result["cuda"] is False and result["failed"] is False
    for name in ("default group", "bf16 model built (CPU)", "bf16 training steps", "switch dp1 -> dp1-zero1",
                 "switch dp1-zero1 -> dp1", "snapshot copy into host memory beside training"):
        assert verdicts[name][0] == "PASS", (name, verdicts[name])
    assert "bit for bit" in verdicts["switch dp1 -> dp1-zero1"][1]
    assert "bfloat16" in verdicts["bf16 model built (CPU)"][1]
    assert verdicts["snapshot copy into host memory beside training"][1].startswith("PlainHostCopier")
    for name in ("memory bound vs torch.cuda.max_memory_allocated", "a switch's shard allocated on the device",
                 "engine GPU test (world 1)", "own model on Transformer Engine's layer spec"):
        assert verdicts[name] == ("SKIP", "no CUDA device on this machine"), name
    assert any("NCCL across ranks" in line for line in result["unchecked"])
