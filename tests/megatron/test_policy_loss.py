"""``PolicyLoss`` on numbers worked out by hand: PPO's clipped objective, where clipping stops the
gradient, the ``k3`` KL term, the per-token contract megatron's schedule reads, and its refusals."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dynatrain.megatron.policy_loss import PolicyLoss

# (ratio, advantage) -> -min(r A, clamp(r, 0.8, 1.2) A), by hand
CLIPPED = [((1.5, 1.0), -1.2), ((0.5, 1.0), -0.5), ((0.5, -1.0), 0.8), ((1.5, -1.0), 1.5), ((1.0, 2.0), -2.0)]


def _batch(ratios, advantages, **extra):
    old = torch.full((1, len(ratios)), -1.0)
    log_probs = old + torch.log(torch.tensor([ratios]))
    return log_probs, {"old_log_probs": old, "advantages": torch.tensor([advantages]), **extra}


def test_the_clipped_objective_per_token():
    log_probs, batch = _batch([c[0][0] for c in CLIPPED], [c[0][1] for c in CLIPPED])
    losses = PolicyLoss(clip=0.2).token_losses(log_probs, batch)
    assert losses[0].tolist() == pytest.approx([c[1] for c in CLIPPED], abs=1e-6)


def test_clipping_stops_the_gradient_only_where_it_binds():
    log_probs, batch = _batch([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0])
    log_probs.requires_grad_(True)
    PolicyLoss(clip=0.2).token_losses(log_probs, batch).sum().backward()
    # d/dlogp of -r A = -r A where the unclipped term is the minimum, else 0
    assert log_probs.grad[0].tolist() == pytest.approx([0.0, -0.5, 0.0, 1.5], abs=1e-6)


def test_the_kl_term_is_k3_against_the_reference():
    log_probs, batch = _batch([1.0, 1.0], [0.0, 0.0], ref_log_probs=torch.tensor([[-1.0, -1.5]]))
    losses = PolicyLoss(kl_coef=0.1).token_losses(log_probs, batch)
    d = -0.5  # ref - log_prob of the second token
    assert losses[0].tolist() == pytest.approx([0.0, 0.1 * (math.exp(d) - d - 1)], abs=1e-7)


def test_the_loss_func_sums_the_scored_tokens_and_counts_them():
    log_probs, batch = _batch([1.0, 1.0, 1.0], [1.0, 2.0, 4.0], loss_mask=torch.tensor([[0.0, 1.0, 1.0]]))
    total, count, report = PolicyLoss().loss_func(batch, -log_probs)  # megatron's output: the cross-entropy
    assert float(total) == pytest.approx(-6.0) and int(count) == 2
    assert report["policy loss"].tolist() == pytest.approx([-6.0, 2.0])
    assert report["clipped tokens"].tolist() == pytest.approx([0.0, 2.0])


def test_what_it_refuses():
    with pytest.raises(ValueError, match="HINT"):
        PolicyLoss(clip=1.5)
    log_probs, batch = _batch([1.0], [1.0])
    with pytest.raises(KeyError, match="ref_log_probs"):
        PolicyLoss(kl_coef=0.1).token_losses(log_probs, batch)
    with pytest.raises(KeyError, match="advantages"):
        PolicyLoss().forward_step(iter([{"tokens": torch.zeros(1, 2, dtype=torch.long)}]), torch.nn.Identity())
