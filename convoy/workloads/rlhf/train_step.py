"""A trainer's GRPO step on groups taken from the store: the policy's and the reference's log-probs of each response
token (logits over the sampling temperature, as the rollouts sampled), advantages relative to each group, the
clipped loss with its KL penalty, one optimizer step. Under DDP the model is the wrapped one: its backward
all-reduces the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from convoy.workloads.rlhf.grpo import group_advantages, grpo_loss


@dataclass(frozen=True)
class StepSettings:
    group_size: int
    temperature: float = 1.0
    clip: float = 0.2
    beta: float = 0.04
    max_grad_norm: float = 1.0


def token_logprobs(model: Any, tokens: torch.Tensor, temperature: float, last: int = 0) -> torch.Tensor:
    """[responses, length]: position t holds log p(tokens[t] | tokens[:t]) (position 0: 0, nothing predicts it).
    ``last`` > 0: only the last ``last`` positions are computed (0 before them): the vocabulary's logits of the
    prompt's positions are never needed, and they are most of a short response's cost (SmolLM2: 49,152 per token).
    Right padding needs no attention mask: a causal model's earlier positions never see it."""
    length = int(tokens.shape[1])
    keep = min(last, length - 1) if last > 0 else length - 1
    logits = model(tokens, logits_to_keep=keep + 1).logits[:, :-1].float() / temperature
    picked = logits.log_softmax(dim=-1).gather(2, tokens[:, length - keep:].unsqueeze(2)).squeeze(2)
    return torch.nn.functional.pad(picked, (length - keep, 0))


def response_span(mask: torch.Tensor) -> int:
    """How many positions at the end hold every row's response (the mask's first 1 in any row, to the end)."""
    columns = mask.any(dim=0).nonzero()
    return int(mask.shape[1]) - int(columns[0]) if len(columns) else 1


def grpo_step(model: Any, reference: Any, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
              settings: StepSettings) -> dict[str, float]:
    """One update on ``batch`` (tokens, mask, logprobs, rewards: whole groups); what it measured."""
    tokens, mask, old = batch["tokens"], batch["mask"], batch["logprobs"]
    advantages = group_advantages(batch["rewards"], settings.group_size)
    span = response_span(mask)
    with torch.no_grad():
        ref = token_logprobs(reference, tokens, settings.temperature, span)
    model.train()
    logp = token_logprobs(model, tokens, settings.temperature, span)
    parts = grpo_loss(logp, old, ref, advantages, mask, settings.clip, settings.beta)
    optimizer.zero_grad(set_to_none=True)
    parts.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
    optimizer.step()
    return {"loss": float(parts.loss.detach()), "kl": parts.kl, "clipped": parts.clipped, "grad_norm": float(norm),
            "reward": float(batch["rewards"].mean())}
