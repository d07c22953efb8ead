"""Steady-state step time: DynaTrainStrategy under a real Trainer vs a hand-written megatron-core loop.

Both sides train the same model (same ``GPTShape``, seed, layout) on the same global batches (same
dataset, ``GlobalBatchSampler`` and DataLoader) in the same processes, alternating in rounds so that
machine noise hits both alike. The plain side is ``run_train_step`` in a ``for`` loop (data-parallel
share cut by hand, same LR/WD setting per step); the Lightning side is ``Trainer.fit`` with
``GPTLightningModule`` (progress bar, logger and checkpointing off; the module still ``self.log``s
the loss and LR every step). A step's time is the interval between consecutive step starts on rank 0,
so data loading and every per-step hook count; the first ``--warmup`` steps of each run are dropped.

    python benchmarks/step_overhead.py --devices 2 --layout dp2-tp1-pp1 --steps 30 --rounds 3 --json

launches itself under ``torch.distributed.run`` (or runs directly when started by torchrun) and
prints a table; with ``--json`` the last line is one JSON object with

- ``overhead_ratio`` (goal <= 1.03): per step, the step interval divided by the time spent inside
  ``run_train_step`` (the megatron work both sides share); median per run; Lightning's over the plain
  loop's; median over rounds. Both numbers of a ratio come from the same step, so load from other
  processes on the machine (which moves whole steps by tens of percent here) mostly cancels.
- ``step_time_ratio``: the plain reading, the best round's median Lightning step time over the best
  round's median plain step time; exact on a quiet machine, noisy on a shared one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2, help="processes (2-4 here)")
    p.add_argument("--layout", default=None, help="layout (default: dp{devices}-tp1-pp1)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    p.add_argument("--rounds", type=int, default=6, help="plain/Lightning pairs, alternating which goes first")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------ the two sides
def _setup(args: argparse.Namespace):
    from lightning_dynatrain.data import GlobalBatchSampler, StdlibBytes
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.runtime.layout_checks import vocab_divisor_for
    from lightning_dynatrain.vps.layout import ParallelConfig

    layout = ParallelConfig.parse(args.layout or f"dp{args.devices}")
    shape = GPTShape(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn_hidden=args.ffn, vocab_size=256,
                     seq_length=args.seq_length, make_vocab_size_divisible_by=vocab_divisor_for(256, [layout.tp]))
    dataset = StdlibBytes(args.seq_length, max_bytes=4_000_000)
    sampler = GlobalBatchSampler(dataset, global_batch_size=args.global_batch, shuffle=True, seed=0)
    return layout, shape, dataset, sampler


LR, WD, SEED = 1e-3, 0.01, 1234
_INNER: list[float] = []  # seconds inside run_train_step, per step, for the run in progress


def _timed_run_train_step(*args, **kwargs) -> float:
    """``run_train_step`` with its own time recorded: the megatron work both sides share."""
    from lightning_dynatrain.megatron.train_step import run_train_step

    start = time.perf_counter()
    loss = run_train_step(*args, **kwargs)
    _INNER.append(time.perf_counter() - start)
    return loss


def plain_run(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Hand-written megatron-core loop; (step-start intervals, time inside run_train_step) after warmup."""
    from torch.utils.data import DataLoader

    from lightning_dynatrain.megatron.gpt import build_gpt_model
    from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy, initialize_for_layout

    layout, shape, dataset, sampler = _setup(args)
    pgs = initialize_for_layout(layout, seed=SEED)
    model = build_gpt_model(shape, layout, seed=SEED)
    ddp, optimizer = build_ddp_and_optimizer(model, layout, lr=LR, weight_decay=WD, adam_beta2=0.95, clip_grad=1.0)
    dp, dp_rank = pgs.dp.size(), pgs.dp.rank()
    per_rank = args.global_batch // dp
    micro = args.global_batch // (dp * args.micro_batch)
    starts = []
    _INNER.clear()
    loader = DataLoader(dataset, batch_sampler=sampler)
    for step, batch in zip(range(args.warmup + args.steps + 1), loader):
        starts.append(time.perf_counter())
        if step == args.warmup + args.steps:
            break
        local = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank] for k, v in batch.items()}
        for group in optimizer.param_groups:  # what the strategy does each step
            group["lr"] = LR * group.get("lr_mult", 1.0)
            group["weight_decay"] = WD * group.get("wd_mult", 1.0)
        _timed_run_train_step(ddp, optimizer, local, layout, micro, pg_collection=pgs)
    destroy()
    return [b - a for a, b in zip(starts, starts[1:])][args.warmup:], _INNER[args.warmup:]


def lightning_run(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The same under Trainer + DynaTrainStrategy + GPTLightningModule."""
    from lightning.pytorch import Callback, Trainer

    from lightning_dynatrain.data.datamodule import GlobalBatchDataLoader
    from lightning_dynatrain.strategy import DynaTrainStrategy, GPTLightningModule
    from lightning_dynatrain.runtime import steps as training_steps

    training_steps.run_train_step = _timed_run_train_step  # the strategy's step calls it through this module
    _INNER.clear()

    layout, shape, dataset, sampler = _setup(args)

    class Clock(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module) -> None:
            self.starts.append(time.perf_counter())

    clock = Clock()
    module = GPTLightningModule(shape, lr=LR, weight_decay=WD, global_batch_size=args.global_batch,
                                micro_batch_size=args.micro_batch, seed=SEED, betas=(0.9, 0.95), clip_grad=1.0)
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=DynaTrainStrategy(layout, seed=SEED),
                      max_steps=args.warmup + args.steps, callbacks=[clock], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=GlobalBatchDataLoader(dataset, batch_sampler=sampler))
    return [b - a for a, b in zip(clock.starts, clock.starts[1:])][args.warmup:], _INNER[args.warmup:]


# ------------------------------------------------------------------------------------------- driver
def worker(args: argparse.Namespace) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    med = statistics.median
    rows = []
    for r in range(args.rounds):
        runs = {}
        for side in (("plain", "lightning") if r % 2 == 0 else ("lightning", "plain")):  # alternate who goes first
            runs[side] = (plain_run if side == "plain" else lightning_run)(args)
        (p_step, p_inner), (l_step, l_inner) = runs["plain"], runs["lightning"]
        # per step: interval / time inside run_train_step; the ratio of the two sides' medians cancels
        # slow phases of the machine that hit a whole step
        p_frac = med(a / b for a, b in zip(p_step, p_inner))
        l_frac = med(a / b for a, b in zip(l_step, l_inner))
        rows.append(dict(plain=med(p_step), lightning=med(l_step), plain_frac=p_frac, lightning_frac=l_frac,
                         plain_inner=med(p_inner), lightning_inner=med(l_inner)))
        if rank == 0:
            print(f"round {r}: plain {med(p_step) * 1e3:7.1f} ms (x{p_frac:.3f} of its megatron step)   "
                  f"lightning {med(l_step) * 1e3:7.1f} ms (x{l_frac:.3f})   step ratio {med(l_step) / med(p_step):.3f}",
                  flush=True)
    if rank == 0:
        plain_ms = min(r["plain"] for r in rows) * 1e3
        lit_ms = min(r["lightning"] for r in rows) * 1e3
        step_ratio = lit_ms / plain_ms
        in_step = med(r["lightning_frac"] / r["plain_frac"] for r in rows)
        print(f"\n{'':22}{'plain megatron':>16}{'DynaTrainStrategy':>20}{'ratio':>8}")
        print(f"{'step time (best round)':22}{plain_ms:13.1f} ms{lit_ms:17.1f} ms{step_ratio:8.3f}")
        print(f"{'step / megatron work':22}{med(r['plain_frac'] for r in rows):16.3f}"
              f"{med(r['lightning_frac'] for r in rows):20.3f}{in_step:8.3f}")
        work_ratio = min(r["lightning_inner"] for r in rows) / min(r["plain_inner"] for r in rows)
        print(f"{'megatron work (best)':22}{min(r['plain_inner'] for r in rows) * 1e3:13.1f} ms"
              f"{min(r['lightning_inner'] for r in rows) * 1e3:17.1f} ms{work_ratio:8.3f}")
        print(f"({args.rounds} rounds x {args.steps} steps after {args.warmup} warmup, {dist.get_world_size()} processes, "
              f"layout {args.layout or f'dp{args.devices}'}, {torch.get_num_threads()} threads each; step time = median "
              "interval between step starts on rank 0)", flush=True)
        if args.json:
            print(json.dumps({
                "overhead_ratio": round(in_step, 4), "step_time_ratio": round(step_ratio, 4),
                "megatron_work_ratio": round(work_ratio, 4),
                "plain_step_ms": round(plain_ms, 2), "lightning_step_ms": round(lit_ms, 2),
                "round_step_ratios": [round(r["lightning"] / r["plain"], 4) for r in rows],
                "world_size": dist.get_world_size(), "layout": args.layout or f"dp{args.devices}",
                "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}), flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.devices}",
           os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
