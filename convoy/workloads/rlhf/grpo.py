"""GRPO's math (pure tensors): advantages relative to each prompt's group, and the clipped policy loss with a KL
penalty to the reference model.

Advantages (DeepSeekMath's GRPO, as TRL computes them by default): each response's reward minus its group's mean,
over the group's standard deviation (Bessel-corrected) plus ``eps``; a group whose rewards are all equal teaches
nothing (its advantages are 0). The loss per token is PPO's clipped surrogate, ``-min(r A, clip(r, 1-e, 1+e) A)``
with ``r = exp(logp - logp_old)``, plus ``beta`` times the k3 estimate of KL(policy || reference),
``exp(ref - logp) - (ref - logp) - 1``; each response's tokens are averaged, then the responses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convoy.errors import ConfigError


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """``rewards`` of consecutive groups of ``group_size`` responses -> one advantage per response."""
    if group_size < 2:
        raise ConfigError(f"a GRPO group needs >= 2 responses to compare, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ConfigError(f"{rewards.numel()} rewards do not make whole groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor
    kl: float
    clipped: float
    """Share of response tokens whose ratio was clipped."""


def grpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, logp_ref: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip: float = 0.2, beta: float = 0.04) -> LossParts:
    """``logp``, ``logp_old``, ``logp_ref``, ``mask``: [responses, tokens] (mask 1 on response tokens);
    ``advantages``: [responses]."""
    if not logp.shape == logp_old.shape == logp_ref.shape == mask.shape or advantages.shape != logp.shape[:1]:
        raise ConfigError(f"GRPO's loss takes log-probs and mask of one shape [responses, tokens] and one advantage "
                          f"per response; got {list(logp.shape)}, {list(logp_old.shape)}, {list(logp_ref.shape)}, "
                          f"{list(mask.shape)} and {list(advantages.shape)}")
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - logp_old)
    gain = advantages.unsqueeze(1)
    surrogate = torch.min(ratio * gain, torch.clamp(ratio, 1 - clip, 1 + clip) * gain)
    to_ref = logp_ref - logp
    kl = torch.exp(to_ref) - to_ref - 1
    per_token = -surrogate + beta * kl
    tokens = mask.sum(dim=1).clamp(min=1)
    loss = ((per_token * mask).sum(dim=1) / tokens).mean()
    with torch.no_grad():
        clipped = (((ratio < 1 - clip) | (ratio > 1 + clip)).to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
        mean_kl = ((kl * mask).sum(dim=1) / tokens).mean()
    return LossParts(loss, float(mean_kl), float(clipped))
