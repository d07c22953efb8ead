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
``OUT/switches.jsonl`` (one JSON object per switch); rank 0 prints one line per switch. With
``--val-root DIR --val-every N`` it validates (``model.eval()``: forward only, at whatever layout runs)
on the ``.py`` files under ``DIR`` whenever the step count is a multiple of ``N`` and writes
``OUT/val.csv``.
``--save-state-at K`` saves the whole state after step K with ``accelerator.save_state(OUT/state)``;
``--resume DIR`` loads one with ``accelerator.load_state(DIR)`` (written at any layout and number of
processes: it loads into this run's layout) and trains on to ``--max-steps``. ``--rollout K:LAYOUT``
samples a few continuations after step K at another layout, in the same processes
(``engine.rollout``: the weights alone switched there and back; ``docs/rollout.md``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from loop_common import Validation, add_run_args, model_of, plugin_of, rollout, summary, write

from lightning_dynatrain.accelerate import DynaTrainEngine
from lightning_dynatrain.data import StdlibBytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, out="runs/accelerate_gpt")
    p.add_argument("--save-state-at", type=int, default=None, help="accelerator.save_state(OUT/state) after this step")
    p.add_argument("--resume", type=Path, default=None, help="accelerator.load_state(DIR) before training")
    return p.parse_args(argv)


def build(accelerator: Accelerator, args: argparse.Namespace) -> DynaTrainEngine:
    """The engine of the Lightning demo's model, optimizer and LR schedule (``GPTLightningModule``'s defaults)."""
    plugin = plugin_of(args)
    return DynaTrainEngine(accelerator, plugin, **model_of(args, plugin, accelerator.num_processes))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(args.seed)
    rows: list[tuple[int, float, str]] = []
    with build(accelerator, args) as engine:
        loader = engine.dataloader(StdlibBytes(args.seq_length), shuffle=True, seed=args.seed)
        model, optimizer, loader, scheduler = accelerator.prepare(engine.model, engine.optimizer, loader,
                                                                  engine.scheduler)
        validation = Validation(args, engine)
        val_loader = None if validation.dataset is None else accelerator.prepare(
            engine.eval_dataloader(validation.dataset))
        if args.resume is not None:
            accelerator.load_state(str(args.resume))
            accelerator.print(f"[accelerate_gpt] resumed from {args.resume} at step {engine.step}, {engine.layout}")
        if line := validation(model, val_loader):
            accelerator.print(f"[accelerate_gpt] {line}")
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
                if line := validation(model, val_loader):
                    accelerator.print(f"[accelerate_gpt] {line}")
                if engine.step == args.save_state_at:
                    accelerator.save_state(str(args.out / "state"))
                if line := rollout(args, engine):
                    accelerator.print(f"[accelerate_gpt] {line}")
                if engine.step >= args.max_steps:
                    break
        seconds = time.perf_counter() - start
        # the loss is reduced over the data-parallel ranks inside the step: every process holds the same floats
        mine = torch.tensor([[loss for _, loss, _ in rows]], dtype=torch.float64, device=accelerator.device)
        everyone = accelerator.gather_for_metrics(mine)
        same = bool((everyone == everyone[0]).all())
        if accelerator.is_main_process:
            write(args.out, rows, engine.history, validation.rows)
        if rows:
            line = summary(rows, seconds, accelerator.num_processes, str(accelerator.distributed_type),
                           len(engine.history), same)
            accelerator.print(f"[accelerate_gpt] {line}; wrote {args.out}/metrics.csv, switches.jsonl", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
