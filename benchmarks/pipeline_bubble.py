"""Step time with and without virtual pipeline stages: ``pp2`` against ``pp2-vpp2``, ``pp4`` against ``pp4-vpp2``.

Megatron's 1F1B leaves each of ``pp`` stages idle for about ``(pp - 1) / m`` of a step of ``m``
micro-batches (the bubble); interleaving ``v`` model chunks per stage cuts that to ``(pp - 1) / (v m)``
at the price of ``v`` times the point-to-point transfers. Here the same GPT (megatron-core, gloo)
trains at each layout in one job per world size, one layout after another, with few micro-batches
per step so that the bubble is a large part of it; every step is timed on rank 0 (the first
``--warmup`` dropped); each layout runs ``--rounds`` times, alternating the order, and a layout's
figure is the median over all its timed steps. Two jobs: 2 processes (``dp1-tp1-pp2`` with 1, 2
and 4 virtual stages: each stage has a core of its own on a 2-core machine, so a stage waiting in
the bubble leaves its core idle, as a GPU would be) and 4 processes (``dp2-tp1-pp2``, ``dp1-tp1-pp4``
with and without two virtual stages: on fewer cores than processes a waiting stage's core runs
another stage, and the bubble mostly does not show as lost time).

    python benchmarks/pipeline_bubble.py                  # 8-layer GPT
    python benchmarks/pipeline_bubble.py --steps 10 --json

Prints a table and, with ``--json``, one JSON object on the last line: per layout its median step
time (``step_seconds``), and ``vpp_over_plain`` per plain layout and number of virtual stages (the
interleaved layout's median over the plain one's; below 1: the bubble shrank more than the
transfers grew).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

#: per world size: the layouts, each plain one first and then its virtual stages
LAYOUTS = {2: ("dp1-tp1-pp2", "dp1-tp1-pp2-vpp2", "dp1-tp1-pp2-vpp4"),
           4: ("dp2-tp1-pp2", "dp2-tp1-pp2-vpp2", "dp1-tp1-pp4", "dp1-tp1-pp4-vpp2")}
SEED, LR = 1234, 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8, help="a multiple of 8 (pp4 with two chunks, pp2 with four)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step and data-parallel rank")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="runs per layout, the order alternating")
    p.add_argument("--worlds", default="2,4", help="the jobs to run, by process count (of 2 and 4)")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    args = p.parse_args(argv)
    args.worlds = [int(w) for w in args.worlds.split(",")]
    if not set(args.worlds) <= set(LAYOUTS):
        p.error(f"--worlds takes {' and '.join(map(str, LAYOUTS))}, got {args.worlds}")
    return args


def _job(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Each of ``LAYOUTS[world]``'s step times on this rank (rank 0's are the figures)."""
    import torch

    from lightning_dynatrain.megatron.gpt import GPTShape, build_gpt_model
    from lightning_dynatrain.megatron.optimizer import adam_config, build_ddp_chunks_and_optimizer
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy, initialize_for_layout
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.vps.layout import ParallelConfig

    shape = GPTShape(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn_hidden=4 * args.hidden,
                     vocab_size=256, seq_length=args.seq_length, make_vocab_size_divisible_by=64)
    order = list(LAYOUTS[world])
    out: dict[str, list[float]] = {text: [] for text in order}
    for round_index in range(args.rounds):
        for text in order if round_index % 2 == 0 else order[::-1]:
            layout = ParallelConfig.parse(text)
            pgs = initialize_for_layout(layout, seed=SEED)
            model = build_gpt_model(shape, layout, seed=SEED)
            chunks, optimizer = build_ddp_chunks_and_optimizer(model, layout, config=adam_config(lr=LR),
                                                               pg_collection=pgs)
            rows = args.microbatches  # one sequence per micro-batch
            generator = torch.Generator().manual_seed(pgs.dp.rank())
            for step in range(args.warmup + args.steps):
                tokens = torch.randint(0, 256, (rows, args.seq_length + 1), generator=generator)
                batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
                start = time.perf_counter()
                run_train_step(chunks, optimizer, batch, layout, args.microbatches, pg_collection=pgs)
                if step >= args.warmup:
                    out[text].append(time.perf_counter() - start)
            destroy()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.baselines.launch import spawn_job
    from lightning_dynatrain.vps.layout import ParallelConfig

    times = {}
    for world in args.worlds:
        times.update(spawn_job(_job, world, args, timeout_s=1800, stamp_entry=False)[0])
    median = {text: statistics.median(values) for text, values in times.items()}
    ratios = {}
    for text in median:
        layout = ParallelConfig.parse(text)
        if layout.vpp > 1:
            ratios[text] = median[text] / median[str(layout.replace(vpp=1))]
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq_length}; {args.microbatches} micro-batches "
          f"per step and data-parallel rank; {args.rounds} x {args.steps} timed steps per layout")
    print(f"{'processes':<11}{'layout':<20}{'median step (s)':>18}{'min (s)':>10}{'over plain':>12}")
    for world in args.worlds:
        for text in LAYOUTS[world]:
            over = f"{ratios[text]:.3f}" if text in ratios else ""
            print(f"{world:<11}{text:<20}{median[text]:>18.4f}{min(times[text]):>10.4f}{over:>12}")
    if args.json:
        print(json.dumps({"layers": args.layers, "hidden": args.hidden, "seq_length": args.seq_length,
                          "microbatches": args.microbatches, "step_seconds": median, "vpp_over_plain": ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
