"""Train the demo's byte-level GPT with a plain Lightning Fabric loop, switching layouts on a schedule.

The same model, data and seed as ``examples/train_gpt.py`` (the Lightning demo) and
``examples/accelerate_gpt.py``, so the three print the same losses step for step; here the loop is
Fabric's (``fabric.setup``, ``model(batch)``, ``fabric.backward``, ``optimizer.step()``) over
``DynaTrainEngine`` under ``DynaTrainFabricStrategy``::

    fabric run --accelerator cpu --devices 4 examples/fabric_gpt.py \\
        --layout dp2-tp2-pp1 --schedule 100:dp1-tp2-pp2,200:dp4 --max-steps 300 --out runs/fabric
    python examples/fabric_gpt.py --devices 4 ...        # Fabric starts the other 3 processes itself

``--accelerator`` defaults to ``cuda`` where there is a GPU, else ``cpu``; ``--precision bf16-true``
trains bf16 params with fp32 main params (megatron's own mixed precision). ``--layout`` and
``--schedule`` default to ``$DYNATRAIN_LAYOUT`` and ``$DYNATRAIN_SCHEDULE``.

Writes (rank 0) ``OUT/metrics.csv`` (step, loss, layout, as the Lightning demo) and
``OUT/switches.jsonl`` (one JSON object per switch); rank 0 prints one line per switch. With
``--val-root DIR --val-every N`` it validates (``model.eval()``: forward only, at whatever layout runs)
on the ``.py`` files under ``DIR`` whenever the step count is a multiple of ``N`` and writes
``OUT/val.csv``.
``--save-at K`` saves the whole state after step K with ``fabric.save(OUT/state, ...)``;
``--resume DIR`` loads one with ``fabric.load(DIR, ...)`` (written at any layout and number of
processes: it loads into this run's layout) and trains on to ``--max-steps``. ``--rollout K:LAYOUT``
samples a few continuations after step K at another layout, in the same processes
(``engine.rollout``: the weights alone switched there and back; ``docs/rollout.md``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from loop_common import Validation, add_run_args, model_of, plugin_of, rollout, summary, write

from lightning_dynatrain.data import StdlibBytes
from lightning_dynatrain.fabric import DynaTrainEngine, DynaTrainFabricStrategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, out="runs/fabric_gpt")
    p.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--devices", default="auto", help="processes per node (fabric run's --devices says it there)")
    p.add_argument("--precision", default="32-true", help='"32-true" or "bf16-true"')
    p.add_argument("--save-at", type=int, default=None, help="fabric.save(OUT/state, ...) after this step")
    p.add_argument("--resume", type=Path, default=None, help="fabric.load(DIR, ...) before training")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    plugin = plugin_of(args)
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, precision=args.precision,
                    strategy=DynaTrainFabricStrategy(plugin))
    if os.environ.get("LT_CLI_USED") != "1":  # under `fabric run`, Fabric() has launched itself (launch() refuses)
        fabric.launch()
    fabric.seed_everything(args.seed)
    rows: list[tuple[int, float, str]] = []
    with DynaTrainEngine(fabric, **model_of(args, plugin, fabric.world_size)) as engine:
        model, optimizer = fabric.setup(engine.model, engine.optimizer)
        loader = fabric.setup_dataloaders(engine.dataloader(StdlibBytes(args.seq_length), shuffle=True, seed=args.seed))
        validation = Validation(args, engine)
        val_loader = None if validation.dataset is None else fabric.setup_dataloaders(
            engine.eval_dataloader(validation.dataset))
        state = {"model": model, "optimizer": optimizer, "engine": engine}
        if args.resume is not None:
            fabric.load(args.resume, state)
            fabric.print(f"[fabric_gpt] resumed from {args.resume} at step {engine.step}, {engine.layout}")
        if line := validation(model, val_loader):
            fabric.print(f"[fabric_gpt] {line}")
        start = time.perf_counter()
        while engine.step < args.max_steps:
            for batch in loader:
                loss = model(batch)
                layout = str(engine.layout)  # the layout this step trained at
                fabric.backward(loss)
                optimizer.step()  # the step boundary: a scheduled switch runs here
                optimizer.zero_grad()
                rows.append((engine.step, loss.item(), layout))
                if args.log_every and engine.step % args.log_every == 0:
                    fabric.print(f"[fabric_gpt] step {engine.step} loss {loss.item():.4f} ({layout})")
                if line := validation(model, val_loader):
                    fabric.print(f"[fabric_gpt] {line}")
                if engine.step == args.save_at:
                    fabric.save(args.out / "state", state)
                if line := rollout(args, engine):
                    fabric.print(f"[fabric_gpt] {line}")
                if engine.step >= args.max_steps:
                    break
        seconds = time.perf_counter() - start
        # the loss is reduced over the data-parallel ranks inside the step: every process holds the same floats
        everyone = fabric.all_gather(torch.tensor([loss for _, loss, _ in rows], dtype=torch.float64))
        same = bool((everyone == everyone[0]).all())
        if fabric.global_rank == 0:
            write(args.out, rows, engine.history, validation.rows)
        if rows:
            launcher = type(fabric.strategy.cluster_environment).__name__
            line = summary(rows, seconds, fabric.world_size, f"Fabric, {launcher}", len(engine.history), same)
            fabric.print(f"[fabric_gpt] {line}; wrote {args.out}/metrics.csv, switches.jsonl", flush=True)


if __name__ == "__main__":
    main()
