"""GRPO in one Lightning run: a tiny GPT learns ``a + b =`` from a 0/1 reward, generating at one
layout and training at another, in the same processes.

    python examples/grpo_arithmetic.py                   # 4 CPU processes, 200 iterations (about a minute)
    python examples/grpo_arithmetic.py --iterations 6 --out runs/grpo-short
    torchrun --nproc-per-node 4 examples/grpo_arithmetic.py

Each iteration (one optimizer step) at a step boundary:

1. ``strategy.rollout(--rollout-layout)`` moves the weights alone to a data-parallel layout
   (``dp4-tp1-pp1``: each rank generates its own share of the rows), the optimizer parked;
2. ``policy.generate`` samples ``--group`` answers to each of ``--prompts`` questions, with each
   answer's log-probability; leaving the phase returns to the training layout (the training shards
   were kept: nothing moves back);
3. the reward is 1 for the right sum, else 0; GRPO's advantage is the reward less its group's mean,
   over the group's standard deviation;
4. ``strategy.train_step(batch, forward_step=PolicyLoss(clip=0.2).forward_step)`` runs the clipped
   policy-gradient loss through megatron's pipeline schedule at the training layout
   (``dp1-tp2-pp2-zero1``: tensor and pipeline parallel, the optimizer sharded).

Tokens: ``0 .. 2 * (operands - 1)`` are the numbers, then ``+`` and ``=``; a question is the four
tokens ``a + b =`` and an answer one token. Writes (rank 0) into ``--out``: ``metrics.csv`` (one
row per iteration: reward, loss, the seconds of entering the rollout, generating, leaving, training,
and the bytes rank 0 sent entering and leaving)
and ``reward.png`` (the reward against time, rollout phases and training steps shaded).
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from torch.utils.data import Dataset

from lightning_dynatrain import DynaTrainStrategy, GPTLightningModule, PolicyLoss
from lightning_dynatrain.data import GlobalBatchDataLoader, GlobalBatchSampler
from lightning_dynatrain.megatron.gpt import GPTShape


class Questions(Dataset):
    """Every ``a + b =`` with ``a, b < operands``: ``prompts`` (4 tokens) and the right ``answers``."""

    def __init__(self, operands: int) -> None:
        self.operands = operands
        self.plus, self.equals = 2 * operands - 1, 2 * operands
        self.vocab_size = 2 * operands + 1

    def __len__(self) -> int:
        return self.operands**2

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        a, b = divmod(i, self.operands)
        return {"prompts": torch.tensor([a, self.plus, b, self.equals]), "answers": torch.tensor(a + b)}


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: each reward less its group's mean, over the group's standard deviation (0 where a
    group's rewards are all equal: nothing to learn from it)."""
    by_group = rewards.view(-1, group)
    centred = by_group - by_group.mean(dim=1, keepdim=True)
    return (centred / (by_group.std(dim=1, keepdim=True) + 1e-6)).view(-1)


class GRPOArithmetic(GPTLightningModule):
    def __init__(self, shape: GPTShape, *, rollout_layout: str, prompts: int, group: int, lr: float,
                 seed: int) -> None:
        super().__init__(shape, lr=lr, global_batch_size=prompts * group, micro_batch_size=prompts * group // 4,
                         clip_grad=1.0, seed=seed)
        self.rollout_layout, self.group = rollout_layout, group
        self.policy_loss = PolicyLoss(clip=0.2)
        self.rows: list[dict[str, float]] = []
        self._start: float | None = None

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        strategy, step = self._strategy(), self.trainer.global_step
        self._start = self._start or time.perf_counter()
        prompts = batch["prompts"].repeat_interleave(self.group, dim=0)
        answers = batch["answers"].repeat_interleave(self.group, dim=0)
        rollout_start = time.perf_counter() - self._start
        with strategy.rollout(self.rollout_layout, park="host", keep_weights=True) as policy:
            generated = time.perf_counter()
            out = policy.generate(prompts, max_new_tokens=1, temperature=1.0, seed=step)
            generated = time.perf_counter() - generated
        rollout_end = time.perf_counter() - self._start
        rewards = (out.tokens[:, -1] == answers).float()
        loss = strategy.train_step(self.rl_batch(out.tokens, out.log_probs, rewards), lr=self.lr_at(step),
                                   forward_step=self.policy_loss.forward_step)
        figures = policy.figures
        self.rows.append({"iteration": step + 1, "reward": rewards.mean().item(), "loss": loss,
                          "enter_s": figures.enter_seconds, "generate_s": generated,
                          "leave_s": figures.leave_seconds, "train_s": time.perf_counter() - self._start - rollout_end,
                          "enter_sent_bytes": figures.enter_report.sent_bytes,
                          "leave_sent_bytes": figures.leave_report.sent_bytes if figures.leave_report else 0,
                          "rollout_start": rollout_start, "rollout_end": rollout_end,
                          "train_end": time.perf_counter() - self._start})
        self.log("reward", rewards.mean().item(), prog_bar=True, batch_size=len(rewards))

    def rl_batch(self, tokens: torch.Tensor, log_probs: torch.Tensor, rewards: torch.Tensor) -> dict:
        """The policy loss's batch: only the generated (last) position is scored."""
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        scored = torch.zeros_like(labels, dtype=torch.float)
        scored[:, -1] = 1
        old = torch.zeros_like(scored)
        old[:, -1] = log_probs[:, 0]
        advantages = group_advantages(rewards, self.group)[:, None] * scored
        return {"tokens": inputs, "labels": labels, "loss_mask": scored, "old_log_probs": old,
                "advantages": advantages}


def write_results(out: Path, rows: list[dict[str, float]], *, rollout_layout: str, train_layout: str) -> None:
    from lightning_dynatrain.viz.reward_plot import RLIteration, plot_rewards

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    marks = [RLIteration(iteration=int(r["iteration"]), reward=r["reward"], rollout_start=r["rollout_start"],
                         rollout_end=r["rollout_end"], train_end=r["train_end"]) for r in rows]
    plot_rewards(out / "reward.png", marks, rollout_layout=rollout_layout, train_layout=train_layout,
                 title="GRPO: a tiny GPT learns a + b = from a 0/1 reward")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--layout", default="dp1-tp2-pp2-zero1", help="the training layout")
    p.add_argument("--rollout-layout", default="dp4-tp1-pp1")
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--operands", type=int, default=5, help="a and b are below this")
    p.add_argument("--prompts", type=int, default=16, help="questions per iteration")
    p.add_argument("--group", type=int, default=8, help="answers sampled per question")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/grpo")
    args = p.parse_args()
    questions = Questions(args.operands)
    shape = GPTShape(hidden=64, layers=4, heads=4, ffn_hidden=128, vocab_size=questions.vocab_size, seq_length=4,
                     make_vocab_size_divisible_by=16)
    module = GRPOArithmetic(shape, rollout_layout=args.rollout_layout, prompts=args.prompts, group=args.group,
                            lr=args.lr, seed=args.seed)
    loader = GlobalBatchDataLoader(questions, batch_sampler=GlobalBatchSampler(
        questions, global_batch_size=args.prompts, shuffle=True, seed=args.seed))
    trainer = Trainer(accelerator="cpu", devices=args.devices, max_steps=args.iterations,
                      strategy=DynaTrainStrategy(args.layout), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False)
    trainer.fit(module, train_dataloaders=loader)
    if trainer.is_global_zero:
        rows = module.rows
        write_results(Path(args.out), rows, rollout_layout=args.rollout_layout, train_layout=args.layout)
        tenth = max(1, len(rows) // 10)
        first = sum(r["reward"] for r in rows[:tenth]) / tenth
        last = sum(r["reward"] for r in rows[-tenth:]) / tenth
        per_iteration = rows[-1]["train_end"] / len(rows)
        switches = sum(r["enter_s"] + r["leave_s"] for r in rows) / len(rows)
        print(f"grpo: {len(rows)} iterations, mean reward {first:.3f} (first {tenth}) -> {last:.3f} (last {tenth}); "
              f"an iteration {per_iteration:.2f} s, its two transitions {switches:.3f} s; {args.out}/reward.png")


if __name__ == "__main__":
    main()
