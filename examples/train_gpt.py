"""Train a small byte-level GPT on the Python stdlib's sources with N CPU processes, switching layouts on a schedule.

    python examples/train_gpt.py --devices 4 --max-steps 300 --layout dp2-tp2-pp1 --out runs/demo
    python examples/train_gpt.py --devices 4 --layout dp2-tp2-pp1 --schedule 100:dp1-tp2-pp2,200:dp4 --out runs/s
    torchrun --nproc-per-node 4 examples/train_gpt.py --devices 4 --schedule schedule.yaml --out runs/t

Writes (rank 0) ``OUT/metrics.csv`` (step, loss, layout), ``OUT/switches.jsonl`` (one JSON object per
switch: step, src, dst, seconds, moved_bytes, retained_bytes, peak_staging_bytes, ...) and
``OUT/loss.png`` (loss against step, switches marked with their times).

The vocabulary (256 bytes) is padded the same way at every TP size the run uses, so every layout
trains the same model (megatron's padded rows take part in the softmax).
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_dynatrain.callbacks import ScheduledReconfig, parse_schedule
from lightning_dynatrain.data import VOCAB_SIZE, StdlibTextDataModule
from lightning_dynatrain.megatron.gpt import GPTShape
from lightning_dynatrain.strategy import DynaTrainStrategy, GPTLightningModule, vocab_divisor_for
from lightning_dynatrain.strategy.report import dumps
from lightning_dynatrain.vps.layout import ParallelConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=4, help="CPU processes")
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--layout", default="auto", help="starting layout, e.g. dp2-tp2-pp1 (auto: pure data parallel)")
    p.add_argument("--schedule", default="", help="STEP:LAYOUT[,STEP:LAYOUT...] or a YAML file (schedule: {200: ...})")
    p.add_argument("--out", type=Path, default=Path("runs/train_gpt"), help="output directory")
    m = p.add_argument_group("model and batch")
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


class RunRecorder(Callback):
    """Rank 0 writes ``metrics.csv`` as steps finish and ``switches.jsonl`` as switches happen."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[tuple[int, float, str]] = []
        self.switches = []
        self._layout = ""
        self._start = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()
        if trainer.is_global_zero:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "switches.jsonl").write_text("")
            with open(self.out / "metrics.csv", "w", newline="") as f:
                csv.writer(f).writerow(["step", "loss", "layout"])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._flush_switches(trainer)
        self._layout = str(trainer.strategy.layout)  # the layout this step runs at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, loss = pl_module.losses[-1]
        self.rows.append((step, loss, self._layout))
        if trainer.is_global_zero:
            with open(self.out / "metrics.csv", "a", newline="") as f:
                csv.writer(f).writerow([step, f"{loss:.6f}", self._layout])

    def on_train_end(self, trainer, pl_module) -> None:
        self._flush_switches(trainer)
        self.seconds = time.perf_counter() - self._start

    def _flush_switches(self, trainer) -> None:
        new = trainer.strategy.switch_history[len(self.switches):]
        self.switches.extend(new)
        if trainer.is_global_zero and new:
            with open(self.out / "switches.jsonl", "a") as f:
                f.writelines(dumps(r) + "\n" for r in new)


def plot(out: Path, rows: list[tuple[int, float, str]], switches: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    steps, losses = [r[0] for r in rows], [r[1] for r in rows]
    ax.plot(steps, losses, lw=1.0, color="tab:blue", label="train loss (global batch mean)")
    for s in switches:
        ax.axvline(s.step, color="tab:red", ls="--", lw=0.8)
        ax.annotate(f"{s.src}\n-> {s.dst}\n{s.seconds:.2f} s", (s.step, max(losses)), fontsize=7, color="tab:red",
                    xytext=(3, -4), textcoords="offset points", va="top")
    start = rows[0][2] if rows else ""
    ax.set(xlabel="optimizer step", ylabel="loss (nats / byte)", title=f"byte-level GPT on the stdlib, start {start}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")  # the switch labels sit at the top
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    seed_everything(args.seed, workers=True)
    schedule = parse_schedule(args.schedule or None)
    start = None if args.layout == "auto" else ParallelConfig.parse(args.layout)
    tps = sorted({1 if start is None else start.tp, *(layout.tp for layout in schedule.values())})
    shape = GPTShape(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn_hidden=args.ffn,
                     vocab_size=VOCAB_SIZE, seq_length=args.seq_length,
                     make_vocab_size_divisible_by=vocab_divisor_for(VOCAB_SIZE, tps))
    module = GPTLightningModule(shape, lr=args.lr, weight_decay=args.weight_decay, global_batch_size=args.global_batch,
                                micro_batch_size=args.micro_batch, warmup_steps=args.warmup, max_steps=args.max_steps,
                                seed=args.seed)
    data = StdlibTextDataModule(seq_length=args.seq_length, global_batch_size=args.global_batch, shuffle=True,
                                seed=args.seed)
    recorder = RunRecorder(args.out)
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=DynaTrainStrategy(args.layout, seed=args.seed),
                      max_steps=args.max_steps, callbacks=[recorder, ScheduledReconfig(schedule)], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      log_every_n_steps=10)
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero and recorder.rows:
        plot(args.out, recorder.rows, recorder.switches)
        first, last = recorder.rows[0][1], sum(r[1] for r in recorder.rows[-10:]) / min(10, len(recorder.rows))
        params = sum(p.numel() for p in module.model.parameters()) if module.model is not None else 0
        print(f"[train_gpt] {len(recorder.rows)} steps in {recorder.seconds:.1f} s on {args.devices} processes "
              f"({torch.get_num_threads()} threads each, {params} params on rank 0): loss {first:.3f} -> {last:.3f} "
              f"(mean of last 10), {len(recorder.switches)} switches; wrote {args.out}/metrics.csv, switches.jsonl, "
              "loss.png", flush=True)


if __name__ == "__main__":
    main()
