"""The RL step's loss: a clipped policy-gradient loss (GRPO / PPO) as a megatron ``forward_step``.

``PolicyLoss(clip=0.2, kl_coef=0.0).forward_step`` is a ``forward_step(data_iterator, model)`` for
megatron's pipeline schedules, so the RL step runs through the same ``train_step`` as pre-training,
at the training layout, with every parallelism (the loss is computed on the last pipeline stage from
the per-token losses megatron's vocabulary-parallel cross-entropy returns). Pass it per step::

    loss = trainer.strategy.train_step(rl_batch, forward_step=PolicyLoss(clip=0.2).forward_step)

A micro-batch holds, every tensor ``[rows, seq]`` with position ``t`` scoring token ``labels[:, t]``:

- ``tokens``, ``labels``: the model's input and the next tokens (a generated sequence shifted by one);
- ``old_log_probs``: each label's log-probability under the policy that sampled it (the rollout's
  ``Generation.log_probs``, placed at the generated positions);
- ``advantages``: each label's advantage (GRPO: the sequence's reward less its group's mean, over the
  group's standard deviation, on every generated position);
- ``loss_mask`` (optional, 1 where a generated token is scored; default: every position);
- ``ref_log_probs`` (needed when ``kl_coef > 0``): the reference policy's log-probabilities.

Per scored token, with ``r = exp(log_prob - old_log_prob)`` and ``A`` its advantage::

    loss = -min(r * A, clamp(r, 1 - clip, 1 + clip) * A) + kl_coef * (exp(d) - d - 1),  d = ref - log_prob

(the KL term is Schulman's unbiased, always non-negative ``k3`` estimate). Summed over the scored
tokens and divided by their count (megatron's per-token contract, over micro-batches and
data-parallel ranks alike), so ``train_step`` returns the global mean policy loss.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial

import torch

REQUIRED = ("tokens", "labels", "old_log_probs", "advantages")


@dataclass(frozen=True, kw_only=True)
class PolicyLoss:
    """A clipped policy-gradient loss (see the module docstring)."""

    clip: float = 0.2
    """PPO's ratio clip: ratios outside ``[1 - clip, 1 + clip]`` get no gradient where clipping binds."""
    kl_coef: float = 0.0
    """Weight of the KL term against ``ref_log_probs`` (0: no reference needed)."""

    def __post_init__(self) -> None:
        if not 0 < self.clip < 1 or self.kl_coef < 0:
            raise ValueError(f"PolicyLoss(clip={self.clip}, kl_coef={self.kl_coef}): "
                             "HINT: 0 < clip < 1 (PPO and GRPO use 0.2) and kl_coef >= 0")

    def token_losses(self, log_probs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The loss of every position (``log_probs``: each label's log-probability now)."""
        log_probs = log_probs.float()
        ratio = torch.exp(log_probs - batch["old_log_probs"].float())
        advantages = batch["advantages"].float()
        loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - self.clip, 1 + self.clip) * advantages)
        if self.kl_coef:
            if "ref_log_probs" not in batch:
                raise KeyError("PolicyLoss(kl_coef > 0) needs `ref_log_probs` [rows, seq] in the batch. "
                               "HINT: score the batch with the reference policy, or pass kl_coef=0")
            d = batch["ref_log_probs"].float() - log_probs
            loss = loss + self.kl_coef * (torch.exp(d) - d - 1)
        return loss

    def loss_func(self, batch: Mapping[str, torch.Tensor], output_tensor: torch.Tensor):
        """Megatron's 3-tuple loss contract on the last stage: ``output_tensor`` holds megatron's
        per-token cross-entropy, the negated log-probability of each label."""
        mask = batch.get("loss_mask")
        mask = torch.ones_like(output_tensor, dtype=torch.float) if mask is None else mask.float()
        losses = self.token_losses(-output_tensor, batch) * mask
        total, count = losses.sum(), mask.sum()
        ratio = torch.exp(-output_tensor.detach().float() - batch["old_log_probs"].float())
        clipped = (((ratio - 1).abs() > self.clip).float() * mask).sum()
        return total, count.to(torch.int), {"policy loss": torch.stack([total.detach(), count]),
                                            "clipped tokens": torch.stack([clipped, count])}

    def forward_step(self, data_iterator: Iterator[Mapping[str, torch.Tensor]], model: torch.nn.Module):
        """Megatron's ``forward_step`` for any GPT-like model whose forward with ``labels`` returns
        the per-token cross-entropy (megatron's ``GPTModel``, the preset, a ``ModelProvider``'s)."""
        batch = next(data_iterator)
        missing = [k for k in REQUIRED if k not in batch]
        if missing:
            raise KeyError(f"the RL batch has no {missing} (it has {sorted(batch)}). HINT: every micro-batch "
                           f"needs {list(REQUIRED)} [rows, seq], optionally loss_mask and ref_log_probs")
        tokens = batch["tokens"]
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        output = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=batch["labels"])
        return output, partial(self.loss_func, batch)


__all__ = ["PolicyLoss"]
