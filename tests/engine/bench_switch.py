"""Engine throughput on a few-MiB switch: ``python -m tests.engine.bench_switch [--world 2 4] [--backend gloo]``.

Builds a small GPT's state on every rank, runs each switch once to warm up and then ``--repeat``
times there and back, and prints per switch the slowest rank's time, the bytes that crossed a process
boundary (all ranks) and the engine's bytes/s over them, beside the measured link speed of the same
group (``measure_link_costs``). Not a test: a tool for the figures in the engine's issue notes.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import torch.distributed as dist

from lightning_dynatrain.engine import execute_switch, measure_link_costs
from lightning_dynatrain.vps.gpt_spec import GPTDims, build_gpt_spec
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.mapping import rank_regions
from lightning_dynatrain.vps.planner import plan_rank
from lightning_dynatrain.vps.spec import Precision
from tests.engine._state import local_state

DIMS = GPTDims(num_layers=4, hidden=256, num_heads=8, ffn_hidden=1024, vocab_size=4000, seq_length=64,
               make_vocab_size_divisible_by=128)
SWITCHES = {2: [("dp2", "tp2"), ("tp2", "pp2-zero1"), ("dp2-zero1", "dp1-tp2")],
            4: [("dp2-tp2", "tp2-pp2-zero1"), ("dp4-zero1", "tp4"), ("dp2-pp2", "dp4-zero1"), ("dp2", "dp4")]}


def _bench(rank: int, world: int, budget: str, repeat: int, device: str) -> list[tuple]:
    spec = build_gpt_spec("bench", DIMS)
    precision = Precision.BF16
    costs = measure_link_costs(nbytes=8 * 2**20)
    out = [("link", costs.p2p_bytes_per_s, costs.broadcast_bytes_per_s)]
    for src_s, dst_s in SWITCHES[world]:
        src, dst = ParallelConfig.parse(src_s), ParallelConfig.parse(dst_s)
        regions = {l: rank_regions(spec, l, rank, precision) if rank < l.world_size else {} for l in (src, dst)}
        plans = {(a, b): plan_rank(spec, a, b, rank, precision=precision) for a, b in ((src, dst), (dst, src))}
        store = {k: v.to(device) for k, v in local_state(spec, src, rank, precision).items()}
        best = None
        for i in range(repeat + 1):
            dist.barrier()
            store, there = execute_switch(plans[(src, dst)], store, regions[src], regions[dst], staging_budget=budget)
            store, back = execute_switch(plans[(dst, src)], store, regions[dst], regions[src], staging_budget=budget)
            if i and (best is None or there.total_seconds < best.total_seconds):
                best = there
        out.append((f"{src}->{dst}", best.total_seconds, best.recv_bytes, best.retained_bytes, str(best)))
    return out


LARGE = GPTDims(num_layers=4, hidden=1024, num_heads=16, ffn_hidden=4096, vocab_size=32000, seq_length=64)


def _bench_local(rank: int, world: int, budget: str, repeat: int, device: str) -> list[str]:
    """World 1, ~1.8 GB of bf16-run state: dp1 -> dp1-zero1 and back is all local copies (grid <-> shards)."""
    spec = build_gpt_spec("large", LARGE)
    precision = Precision.BF16
    src, dst = ParallelConfig.parse("dp1"), ParallelConfig.parse("dp1-zero1")
    regions = {l: rank_regions(spec, l, 0, precision) for l in (src, dst)}
    store = {}
    for (name, kind), lst in regions[src].items():
        dtype = torch.bfloat16 if kind.value == "param" else torch.float32
        for region in lst:
            layers = region.box.hi[0] - region.box.lo[0] if len(region.origin) > len(region.view_shape) else 1
            for i in range(layers):
                stack = (region.box.lo[0] + i,) if len(region.origin) > len(region.view_shape) else ()
                store[(name, kind, stack)] = torch.ones(math.prod(region.view_shape), dtype=dtype, device=device)
    plans = [plan_rank(spec, src, dst, 0, precision=precision), plan_rank(spec, dst, src, 0, precision=precision)]
    lines = []
    for _ in range(repeat + 1):
        store, there = execute_switch(plans[0], store, regions[src], regions[dst], staging_budget=budget)
        store, back = execute_switch(plans[1], store, regions[dst], regions[src], staging_budget=budget)
        lines += [str(there), str(back)]
    return lines[-2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--budget", default="64MiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--local", action="store_true", help="world 1, large state, local copies only")
    parser.add_argument("--verbose", action="store_true", help="print every rank's report")
    args = parser.parse_args()
    from tests.dist import run_distributed

    device = "cuda" if args.backend == "nccl" else "cpu"
    if args.local:
        for line in run_distributed(_bench_local, 1, args.budget, args.repeat, device, backend=args.backend, timeout_s=180)[0]:
            print(line)
        return
    for world in args.world:
        start = time.perf_counter()
        per_rank = run_distributed(_bench, world, args.budget, args.repeat, device, backend=args.backend, timeout_s=600)
        _, p2p, bcast = per_rank[0][0]
        print(f"world {world} ({args.backend}, budget {args.budget}): link p2p {p2p / 2**20:.0f} MiB/s per direction, "
              f"broadcast {bcast / 2**20:.0f} MiB/s; job {time.perf_counter() - start:.1f}s")
        for rows in zip(*[r[1:] for r in per_rank]):
            seconds = max(r[1] for r in rows)
            moved = sum(r[2] for r in rows)
            kept = sum(r[3] for r in rows)
            print(f"  {rows[0][0]:40s} {seconds * 1e3:8.1f} ms  moved {moved / 2**20:7.2f} MiB "
                  f"({moved / seconds / 2**20:7.0f} MiB/s)  retained {kept / 2**20:7.2f} MiB")
        if args.verbose:
            for r in per_rank:
                for row in r[1:]:
                    print("   ", row[4])


if __name__ == "__main__":
    main()
