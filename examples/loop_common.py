"""What ``accelerate_gpt.py`` and ``fabric_gpt.py`` share: the Lightning demo's model, optimizer and LR
schedule as command-line flags, validation on held-out sources, and the files a run writes
(``metrics.csv`` as the Lightning demo, ``switches.jsonl``, ``val.csv``)."""

from __future__ import annotations

import argparse
import csv
from functools import partial
from pathlib import Path

from lightning_dynatrain.accelerate import DynaTrainEngine, DynaTrainPlugin
from lightning_dynatrain.data import VOCAB_SIZE, StdlibBytes
from lightning_dynatrain.megatron.gpt import GPTShape
from lightning_dynatrain.runtime.layout_checks import vocab_divisor_for
from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe, warmup_cosine_lr
from lightning_dynatrain.runtime.reconfig_report import dumps


def add_run_args(p: argparse.ArgumentParser, *, out: str) -> None:
    """The flags of a run: steps, layout, schedule, output, checkpoints, and the model (as train_gpt.py)."""
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--layout", default=None, help="starting layout, e.g. dp2-tp2-pp1 (default $DYNATRAIN_LAYOUT, "
                   "else auto: pure data parallel)")
    p.add_argument("--schedule", default=None, help="STEP:LAYOUT[,STEP:LAYOUT...] or a YAML file "
                   "(default $DYNATRAIN_SCHEDULE)")
    p.add_argument("--staging-budget", default=None, help="bytes a switch may stage at once (default 256MiB)")
    p.add_argument("--out", type=Path, default=Path(out), help="output directory")
    p.add_argument("--log-every", type=int, default=0, help="print the loss every N steps (0: never)")
    p.add_argument("--val-root", type=Path, default=None, help="validate on the .py files under this directory "
                   "(held out: not the stdlib the model trains on), e.g. lightning_dynatrain")
    p.add_argument("--val-every", type=int, default=0, help="validate when the step count is a multiple of N, "
                   "the run's first step count included (0: never)")
    p.add_argument("--val-batches", type=int, default=2, help="global batches per validation")
    p.add_argument("--rollout", default=None, metavar="STEP:LAYOUT",
                   help="after step STEP, sample a few continuations at LAYOUT (a rollout phase: the weights alone "
                   "switched there and back, the optimizer's state parked; docs/rollout.md)")
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


def plugin_of(args: argparse.Namespace) -> DynaTrainPlugin:
    return DynaTrainPlugin(layout=args.layout, schedule=args.schedule, staging_budget=args.staging_budget,
                           seed=args.seed)


def model_of(args: argparse.Namespace, plugin: DynaTrainPlugin, world_size: int) -> dict:
    """``DynaTrainEngine``'s keyword arguments for the Lightning demo's model (``GPTLightningModule``'s
    defaults): ``recipe``, ``adam`` and ``lr_at``; the vocabulary is padded for every tensor-parallel
    size the run will use."""
    start = plugin.start_layout(world_size)
    tps = sorted({start.tp, *(layout.tp for _, layout in plugin.schedule)})
    shape = GPTShape(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn_hidden=args.ffn,
                     vocab_size=VOCAB_SIZE, seq_length=args.seq_length,
                     make_vocab_size_divisible_by=vocab_divisor_for(VOCAB_SIZE, tps))
    recipe = MegatronRecipe(model=shape, seed=args.seed, global_batch_size=args.global_batch,
                            micro_batch_size=args.micro_batch)
    return dict(recipe=recipe, adam=AdamSettings(lr=args.lr, weight_decay=args.weight_decay),
                lr_at=partial(warmup_cosine_lr, peak=args.lr, warmup_steps=args.warmup, max_steps=args.max_steps))


class Validation:
    """Validation of a run: the mean forward-only loss of the first ``--val-batches`` global batches
    of ``--val-root``'s sources, whenever the step count is a multiple of ``--val-every``.

    ``loader`` is the engine's ``eval_dataloader`` (as the library's loop set it up); ``model`` the
    engine's model as the library wrapped it: ``model.eval()`` makes ``model(batch)`` forward only.
    """

    def __init__(self, args: argparse.Namespace, engine: DynaTrainEngine) -> None:
        self.every, self.batches, self.engine = args.val_every, args.val_batches, engine
        self.dataset = None if args.val_root is None or not args.val_every else StdlibBytes(args.seq_length,
                                                                                            root=args.val_root)
        self.rows: list[tuple[int, float, str]] = []

    def __call__(self, model, loader) -> str | None:
        """Validate if due now; the line to print, else ``None``."""
        if self.dataset is None or self.engine.step % self.every:
            return None
        model.eval()
        losses = [model(batch).item() for batch, _ in zip(loader, range(self.batches))]
        model.train()
        loss = sum(losses) / len(losses)
        self.rows.append((self.engine.step, loss, str(self.engine.layout)))
        return f"step {self.engine.step} val_loss {loss:.4f} ({self.engine.layout})"


def rollout(args: argparse.Namespace, engine: DynaTrainEngine) -> str | None:
    """``--rollout STEP:LAYOUT``: after step STEP, four prompts from the standard library continued by 8
    sampled bytes at LAYOUT, between two steps; the line to print (``None`` at other steps)."""
    import torch

    if args.rollout is None or engine.step != int(args.rollout.split(":")[0]):
        return None
    layout = args.rollout.split(":", 1)[1]
    prompts = torch.tensor([list(text.encode()) for text in ("def main(", "import os", "class Foo", "return x ")])
    with engine.rollout(layout, park="host") as policy:
        out = policy.generate(prompts, max_new_tokens=8, temperature=0.8, top_k=32, seed=engine.step)
    sampled = [bytes(row[prompts.shape[1]:].tolist()).decode(errors="replace") for row in out.tokens]
    figures = policy.figures
    return (f"rollout at {layout} after step {engine.step}: {sampled[0]!r} after {'def main('!r}, mean log-prob "
            f"{out.log_probs.mean().item():.3f}; in {figures.enter_seconds:.2f} s, out {figures.leave_seconds:.2f} s")


def write(out: Path, rows: list[tuple[int, float, str]], history: list,
          val_rows: list[tuple[int, float, str]] = ()) -> None:
    """``metrics.csv`` as the Lightning demo writes it, ``switches.jsonl``, and ``val.csv`` if validated."""
    out.mkdir(parents=True, exist_ok=True)
    for name, header, table in (("metrics.csv", "loss", rows), ("val.csv", "val_loss", val_rows)):
        if table or name == "metrics.csv":
            with open(out / name, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["step", header, "layout"])
                writer.writerows([step, f"{loss:.6f}", layout] for step, loss, layout in table)
    (out / "switches.jsonl").write_text("".join(dumps(report) + "\n" for report in history))


def summary(rows: list[tuple[int, float, str]], seconds: float, processes: int, how: str, switches: int,
            same: bool) -> str:
    """The run's last line."""
    last = sum(r[1] for r in rows[-10:]) / max(1, min(10, len(rows)))
    return (f"{len(rows)} steps in {seconds:.1f} s on {processes} processes ({how}): loss {rows[0][1]:.3f} -> "
            f"{last:.3f} (mean of last 10), {switches} switches, losses {'identical' if same else 'DIFFERENT'} "
            "on every process")
