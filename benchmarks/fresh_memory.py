"""What fresh memory costs on this machine, next to writing memory already touched.

A hot switch on CPU writes new state, and megatron's DDP zeroes new gradient (and zero1 param)
buffers. Writing into fresh memory costs a page fault and a kernel zero per page first; writing
into memory the process already touched does not. This measures both, in 1 and in 4 processes at
once (as the switch benchmark's ranks do), with and without PyTorch's transparent huge pages
(``THP_MEM_ALLOC_ENABLE``): ``torch.zeros(n)`` of fresh memory, and ``zero_()`` of a tensor of the
same size written once before; then it frees that tensor ("give back": the kernel takes its
pages, what a rollout model's end costs on CPU). It also zeroes memory the process freed a moment
ago and memory it freed ``--wait`` seconds ago: a virtual machine whose guest reports free pages to its host (Linux
``page_reporting``, shown when present) gives memory freed a while ago back to the host, and the
next write there costs a fault on the host as well; memory freed a moment ago may not be reported
yet. Either way it is the allocator that decides: PyTorch's CPU allocator frees large blocks to
the kernel, a GPU's caching allocator keeps them.

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


def _job(rank: int, world: int, nbytes: int, wait_s: float) -> dict:
    import torch
    import torch.distributed as dist

    def timed_zeros() -> tuple[torch.Tensor, float]:
        dist.barrier()
        start = time.perf_counter()
        tensor = torch.zeros(nbytes // 4)
        return tensor, time.perf_counter() - start

    fresh, fresh_s = timed_zeros()
    dist.barrier()
    start = time.perf_counter()
    fresh.zero_()  # the same memory again: touched
    touched_s = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    del fresh  # back to the kernel (a large block), then at once into a new tensor
    give_back_s = time.perf_counter() - start
    again, just_freed_s = timed_zeros()
    del again
    time.sleep(wait_s)
    _, freed_before_s = timed_zeros()
    return {"fresh_s": fresh_s, "touched_s": touched_s, "give_back_s": give_back_s, "just_freed_s": just_freed_s,
            "freed_before_s": freed_before_s}


def page_reporting() -> dict[str, str]:
    """The guest kernel's free page reporting parameters, where it has them (else empty)."""
    folder = Path("/sys/module/page_reporting/parameters")
    if not folder.is_dir():
        return {}
    return {f.name: f.read_text().strip() for f in sorted(folder.iterdir()) if f.is_file()}


COLUMNS = {"fresh": "fresh", "touched": "touched", "give_back": "give back", "just_freed": "just freed",
           "freed_before": "freed before"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="bytes each process zeroes, in GiB")
    p.add_argument("--wait", type=float, default=5.0, help="seconds between freeing and the 'freed before' zeroing")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = p.parse_args(argv)
    from benchmarks.baselines.launch import spawn_job

    nbytes = int(args.gib * 2**30)
    rows = []
    for thp in ("0", "1"):
        os.environ["THP_MEM_ALLOC_ENABLE"] = thp  # read by each spawned process's allocator
        for world in (1, 4):
            ranks = spawn_job(_job, world, nbytes, args.wait)
            row = dict(thp=thp == "1", processes=world, gib_each=args.gib)
            for name in COLUMNS:
                seconds = max(r[f"{name}_s"] for r in ranks)  # the slowest process
                row[f"{name}_seconds"] = seconds
                row[f"{name}_gb_per_s"] = world * nbytes / seconds / 1e9
            rows.append(row)
    reporting = page_reporting()
    print("free page reporting to the host: " + (", ".join(f"{k}={v}" for k, v in reporting.items()) or "none"))
    print(f"GB/s, all processes together; 'freed before': freed {args.wait:g} s earlier")
    print(f"{'THP':>5} {'procs':>5} {'GiB each':>8} " + " ".join(f"{COLUMNS[n]:>13}" for n in COLUMNS))
    for r in rows:
        print(f"{str(r['thp']):>5} {r['processes']:>5} {r['gib_each']:>8.1f} "
              + " ".join(f"{r[f'{n}_gb_per_s']:>13.2f}" for n in COLUMNS))
    if args.json:
        print(json.dumps({"page_reporting": reporting, "wait_seconds": args.wait, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
