"""What fresh memory costs on this machine, next to writing memory already touched.

A hot switch on CPU writes new state, and megatron's DDP zeroes new gradient (and zero1 param)
buffers. Writing into fresh memory costs a page fault and a kernel zero per page first; writing
into memory the process already touched does not. This measures both, in 1 and in 4 processes at
once (as the switch benchmark's ranks do), with and without PyTorch's transparent huge pages
(``THP_MEM_ALLOC_ENABLE``): ``torch.zeros(n)`` of fresh memory, and ``zero_()`` of a tensor of the
same size written once before.

Usage::

    python benchmarks/fresh_memory.py              # 2 GiB per process
    python benchmarks/fresh_memory.py --gib 1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _job(rank: int, world: int, nbytes: int) -> dict:
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fresh = torch.zeros(nbytes // 4)
    fresh_s = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    fresh.zero_()  # the same memory again: touched
    touched_s = time.perf_counter() - start
    return {"fresh_s": fresh_s, "touched_s": touched_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="bytes each process zeroes, in GiB")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = p.parse_args(argv)
    from lightning_dynatrain.baselines.launch import spawn_job

    nbytes = int(args.gib * 2**30)
    rows = []
    for thp in ("0", "1"):
        os.environ["THP_MEM_ALLOC_ENABLE"] = thp  # read by each spawned process's allocator
        for world in (1, 4):
            ranks = spawn_job(_job, world, nbytes)
            fresh, touched = (max(r[k] for r in ranks) for k in ("fresh_s", "touched_s"))
            rows.append(dict(thp=thp == "1", processes=world, gib_each=args.gib, fresh_seconds=fresh,
                             touched_seconds=touched, fresh_gb_per_s=world * nbytes / fresh / 1e9,
                             touched_gb_per_s=world * nbytes / touched / 1e9))
    print(f"{'THP':>5} {'procs':>5} {'GiB each':>8} {'fresh s':>8} {'touched s':>9} {'fresh GB/s':>10} {'touched GB/s':>12}")
    for r in rows:
        print(f"{str(r['thp']):>5} {r['processes']:>5} {r['gib_each']:>8.1f} {r['fresh_seconds']:>8.2f} "
              f"{r['touched_seconds']:>9.2f} {r['fresh_gb_per_s']:>10.2f} {r['touched_gb_per_s']:>12.2f}")
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
