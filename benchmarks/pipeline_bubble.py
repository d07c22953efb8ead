"""Step time with and without virtual pipeline stages: ``pp2`` against ``pp2-vpp2``, ``pp4`` against ``pp4-vpp2``.

Megatron's 1F1B leaves each of ``pp`` stages idle for about ``(pp - 1) / m`` of a step of ``m``
micro-batches (the bubble); interleaving ``v`` model chunks per stage cuts that to ``(pp - 1) / (v m)``
at the price of ``v`` times the point-to-point transfers. Here 4 processes train the same GPT
(megatron-core, gloo) at each layout in the same job, one layout after another, with few
micro-batches per step so that the bubble is a large part of it, and time every step on rank 0
(the first ``--warmup`` dropped); each layout runs ``--rounds`` times, alternating the order, and
a layout's figure is the median over all its timed steps.

    python benchmarks/pipeline_bubble.py                  # 8-layer GPT, 4 processes
    python benchmarks/pipeline_bubble.py --steps 10 --json

Prints a table and, with ``--json``, one JSON object on the last line: per layout its median step
time (``step_seconds``), and ``vpp_over_plain`` per pipeline depth (the interleaved layout's median
over the plain one's; below 1: the bubble shrank more than the transfers grew). On a machine with
fewer cores than processes an idle stage's core goes to another stage, so part of the bubble does
not show as lost time there (``benchmarks/RESULTS.md`` says what this machine showed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

LAYOUTS = ("dp2-tp1-pp2", "dp2-tp1-pp2-vpp2", "dp1-tp1-pp4", "dp1-tp1-pp4-vpp2")
SEED, LR = 1234, 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8, help="a multiple of 8 (pp4 with two chunks each)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step and data-parallel rank")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="runs per layout, the order alternating")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    return p.parse_args(argv)


def _job(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    import torch

    from lightning_dynatrain.megatron.gpt import GPTShape, build_gpt_model
    from lightning_dynatrain.megatron.optimizer import adam_config, build_ddp_chunks_and_optimizer
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy, initialize_for_layout
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.vps.layout import ParallelConfig

    shape = GPTShape(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn_hidden=4 * args.hidden,
                     vocab_size=256, seq_length=args.seq_length, make_vocab_size_divisible_by=64)
    out: dict[str, list[float]] = {text: [] for text in LAYOUTS}
    order = list(LAYOUTS)
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

    times = spawn_job(_job, 4, args, timeout_s=1800, stamp_entry=False)[0]
    median = {text: statistics.median(values) for text, values in times.items()}
    ratios = {f"pp{pp}": median[f"{plain}-vpp2"] / median[plain]
              for pp, plain in ((2, "dp2-tp1-pp2"), (4, "dp1-tp1-pp4"))}
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq_length}; {args.microbatches} micro-batches "
          f"per step and data-parallel rank; 4 processes; {args.rounds} x {args.steps} timed steps per layout")
    print(f"{'layout':<20}{'median step (s)':>18}{'min (s)':>10}")
    for text in LAYOUTS:
        print(f"{text:<20}{median[text]:>18.4f}{min(times[text]):>10.4f}")
    for depth, ratio in ratios.items():
        print(f"{depth}: vpp2 / plain = {ratio:.3f}")
    if args.json:
        print(json.dumps({"layers": args.layers, "hidden": args.hidden, "seq_length": args.seq_length,
                          "microbatches": args.microbatches, "step_seconds": median, "vpp_over_plain": ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
