"""Train the demo's byte-level GPT with a plain Accelerate loop, switching layouts on a schedule.

The same model, data and seed as ``examples/train_gpt.py`` (the Lightning demo), so the two print
the same losses step for step; here the loop is Accelerate's (``accelerator.prepare``,
``model(batch)``, ``accelerator.backward``, ``optimizer.step()``) over ``DynaTrainEngine``::

    accelerate launch --multi_gpu --num_processes 4 examples/accelerate_gpt.py \\
        --layout dp2-tp2-pp1 --schedule 100:dp1-tp2-pp2,200:dp4 --max-steps 300 --out runs/accel

On a machine without GPUs the script builds ``Accelerator(cpu=True)``: with ``--multi_gpu`` that
starts 4 processes in Accelerate's MULTI_CPU mode (gloo); ``accelerate launch --cpu`` would start one.
``--layout`` and ``--schedule`` default to ``$DYNATRAIN_LAYOUT`` and ``$DYNATRAIN_SCHEDULE``.

Writes (rank 0) ``OUT/metrics.csv`` (step, loss, layout, as the Lightning demo) and
``OUT/switches.jsonl`` (one JSON object per switch); rank 0 prints one line per switch.
``--save-state-at K`` saves the whole state after step K with ``accelerator.save_state(OUT/state)``;
``--resume DIR`` loads one with ``accelerator.load_state(DIR)`` (at any layout of the same number
of processes: the engine switches to the checkpoint's layout first) and trains on to ``--max-steps``.
"""

from __future__ import annotations

import argparse
import csv
import time
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from lightning_dynatrain.accelerate import DynaTrainEngine, DynaTrainPlugin
from lightning_dynatrain.data import VOCAB_SIZE, StdlibBytes
from lightning_dynatrain.megatron.gpt import GPTShape
from lightning_dynatrain.strategy import AdamSettings, MegatronRecipe, vocab_divisor_for, warmup_cosine_lr
from lightning_dynatrain.strategy.report import dumps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--layout", default=None, help="starting layout, e.g. dp2-tp2-pp1 (default $DYNATRAIN_LAYOUT, "
                   "else auto: pure data parallel)")
    p.add_argument("--schedule", default=None, help="STEP:LAYOUT[,STEP:LAYOUT...] or a YAML file "
                   "(default $DYNATRAIN_SCHEDULE)")
    p.add_argument("--staging-budget", default=None, help="bytes a switch may stage at once (default 256MiB)")
    p.add_argument("--out", type=Path, default=Path("runs/accelerate_gpt"), help="output directory")
    p.add_argument("--save-state-at", type=int, default=None, help="accelerator.save_state(OUT/state) after this step")
    p.add_argument("--resume", type=Path, default=None, help="accelerator.load_state(DIR) before training")
    p.add_argument("--log-every", type=int, default=0, help="print the loss every N steps (0: never)")
    m = p.add_argument_group("model and batch (as examples/train_gpt.py)")
    m.add_argument("--hidden", type=int, default=128)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--ffn", type=int, default=512)
    m.add_argument("--seq-length", type=int, default=128)
    m.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step (all ranks)")
    m.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    m.add_argument("--lr", type=float, default=3e-3)
    m.add_argument("--warmup", type=int, default=30)
    m.add_argument("--weight-decay", type=float, default=0.01)
    m.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def build(accelerator: Accelerator, args: argparse.Namespace) -> DynaTrainEngine:
    """The engine of the Lightning demo's model, optimizer and LR schedule (``GPTLightningModule``'s defaults)."""
    plugin = DynaTrainPlugin(layout=args.layout, schedule=args.schedule, staging_budget=args.staging_budget,
                             seed=args.seed)
    start = plugin.start_layout(accelerator.num_processes)
    tps = sorted({start.tp, *(layout.tp for _, layout in plugin.schedule)})
    shape = GPTShape(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn_hidden=args.ffn,
                     vocab_size=VOCAB_SIZE, seq_length=args.seq_length,
                     make_vocab_size_divisible_by=vocab_divisor_for(VOCAB_SIZE, tps))
    recipe = MegatronRecipe(shape=shape, seed=args.seed, global_batch_size=args.global_batch,
                            micro_batch_size=args.micro_batch)
    adam = AdamSettings(lr=args.lr, weight_decay=args.weight_decay)
    lr_at = partial(warmup_cosine_lr, peak=args.lr, warmup_steps=args.warmup, max_steps=args.max_steps)
    return DynaTrainEngine(accelerator, plugin, recipe=recipe, adam=adam, lr_at=lr_at)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(args.seed)
    rows: list[tuple[int, float, str]] = []
    with build(accelerator, args) as engine:
        loader = engine.dataloader(StdlibBytes(args.seq_length), shuffle=True, seed=args.seed)
        model, optimizer, loader, scheduler = accelerator.prepare(engine.model, engine.optimizer, loader,
                                                                  engine.scheduler)
        if args.resume is not None:
            accelerator.load_state(str(args.resume))
            accelerator.print(f"[accelerate_gpt] resumed from {args.resume} at step {engine.step}, {engine.layout}")
        start = time.perf_counter()
        while engine.step < args.max_steps:
            for batch in loader:
                loss = model(batch)
                layout = str(engine.layout)  # the layout this step trained at
                accelerator.backward(loss)
                optimizer.step()  # the step boundary: a scheduled switch runs here
                scheduler.step()
                optimizer.zero_grad()
                rows.append((engine.step, loss.item(), layout))
                if args.log_every and engine.step % args.log_every == 0:
                    accelerator.print(f"[accelerate_gpt] step {engine.step} loss {loss.item():.4f} ({layout})")
                if engine.step == args.save_state_at:
                    accelerator.save_state(str(args.out / "state"))
                if engine.step >= args.max_steps:
                    break
        seconds = time.perf_counter() - start
        # the loss is reduced over the data-parallel ranks inside the step: every process holds the same floats
        mine = torch.tensor([[loss for _, loss, _ in rows]], dtype=torch.float64, device=accelerator.device)
        everyone = accelerator.gather_for_metrics(mine)
        same = bool((everyone == everyone[0]).all())
        if accelerator.is_main_process:
            write(args.out, rows, engine.history)
        if rows:
            last = sum(r[1] for r in rows[-10:]) / min(10, len(rows))
            accelerator.print(
                f"[accelerate_gpt] {len(rows)} steps in {seconds:.1f} s on {accelerator.num_processes} processes "
                f"({accelerator.distributed_type}): loss {rows[0][1]:.3f} -> {last:.3f} (mean of last 10), "
                f"{len(engine.history)} switches, losses {'identical' if same else 'DIFFERENT'} on every process; "
                f"wrote {args.out}/metrics.csv, switches.jsonl", flush=True)
    accelerator.end_training()


def write(out: Path, rows: list[tuple[int, float, str]], history: list) -> None:
    """``metrics.csv`` as the Lightning demo writes it, and ``switches.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss", "layout"])
        writer.writerows([step, f"{loss:.6f}", layout] for step, loss, layout in rows)
    (out / "switches.jsonl").write_text("".join(dumps(report) + "\n" for report in history))


if __name__ == "__main__":
    main()
