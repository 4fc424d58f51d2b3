"""GRPO's advantages and loss against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from convoy.errors import ConfigError
from convoy.workloads.rlhf.grpo import group_advantages, grpo_loss


def test_advantages_are_relative_to_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    advantages = group_advantages(rewards, group_size=4, eps=0.0)
    # group 1: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 * sqrt(3)
    half = 0.5 * math.sqrt(3)
    assert torch.allclose(advantages[:4], torch.tensor([half, -half, -half, half]))
    assert torch.equal(group_advantages(rewards, 4)[4:], torch.zeros(4)), "equal rewards teach nothing"


def test_advantages_refuse_partial_groups() -> None:
    with pytest.raises(ConfigError, match="whole groups"):
        group_advantages(torch.ones(5), group_size=2)
    with pytest.raises(ConfigError, match=">= 2"):
        group_advantages(torch.ones(4), group_size=1)


def test_the_loss_by_hand() -> None:
    logp_old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.8, 0.5, 0.5], [0.25, 0.5, 0.9]]))
    logp_ref = logp_old.clone()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = torch.tensor([1.0, -1.0])
    parts = grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip=0.2, beta=0.0)
    # response 1 (A=+1): ratios 1.6 (clipped to 1.2), 1.0 -> mean(-1.2, -1.0) = -1.1
    # response 2 (A=-1): ratios 0.5, 1.0, 1.8 -> min(r*A, clip(r)*A) = -0.8, -1.0, -1.8 -> mean(0.8, 1.0, 1.8) = 1.2
    assert parts.loss.item() == pytest.approx((-1.1 + 1.2) / 2, abs=1e-6)
    assert parts.clipped == pytest.approx(3 / 5)  # 1.6, 0.5 and 1.8 are outside [0.8, 1.2]
    with_kl = grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip=0.2, beta=0.1)

    def k3(p: float, ref: float = 0.5) -> float:
        return ref / p - math.log(ref / p) - 1

    kl = ((k3(0.8) + k3(0.5)) / 2 + (k3(0.25) + k3(0.5) + k3(0.9)) / 3) / 2
    assert with_kl.kl == pytest.approx(kl, rel=1e-5)
    assert with_kl.loss.item() == pytest.approx(parts.loss.item() + 0.1 * kl, rel=1e-5)


def test_a_descent_step_raises_the_log_probs_of_what_did_better() -> None:
    logp = torch.full((2, 3), math.log(0.5), requires_grad=True)
    parts = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    parts.loss.backward()
    assert logp.grad is not None
    assert bool((logp.grad[0] < 0).all()) and bool((logp.grad[1] > 0).all())


def test_the_loss_refuses_mismatched_shapes() -> None:
    with pytest.raises(ConfigError, match="one shape"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
