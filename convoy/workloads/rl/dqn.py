"""DQN's network and loss: a Q-network over a vector observation, double DQN's target (the online network picks
the next action, the target network values it), a Huber loss weighted by prioritized replay's importance weights,
and the new priorities (|TD error|)."""

from __future__ import annotations

import torch
from torch import nn


def q_network(obs_size: int, actions: int, hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Linear(obs_size, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, actions))


def double_dqn_loss(online: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor],
                    weights: torch.Tensor | None = None, picker: nn.Module | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, |TD error| per transition). ``batch['discount']`` is gamma^n, 0 past an episode's end. ``picker``
    chooses the next action (default ``online``; the module under DDP's wrapper, so that only the forward whose
    gradients are reduced goes through DDP)."""
    q = online(batch["obs"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
    with torch.no_grad():
        best = (picker or online)(batch["next_obs"]).argmax(dim=1, keepdim=True)
        next_q = target(batch["next_obs"]).gather(1, best).squeeze(1)
        wanted = batch["reward"] + batch["discount"] * next_q
    td = q - wanted
    losses = nn.functional.smooth_l1_loss(q, wanted, reduction="none")
    loss = (losses * weights).mean() if weights is not None else losses.mean()
    return loss, td.detach().abs()


def greedy_or_random(q_values: torch.Tensor, epsilon: float, generator: torch.Generator) -> int:
    """Epsilon-greedy: a random action with probability ``epsilon``, else the best one."""
    if float(torch.rand((), generator=generator)) < epsilon:
        return int(torch.randint(q_values.shape[-1], (), generator=generator))
    return int(q_values.argmax())


def epsilon_at(env_steps: int, start: float, end: float, decay_steps: int) -> float:
    """Linear decay from ``start`` to ``end`` over ``decay_steps`` environment steps of the whole job."""
    if decay_steps <= 0:
        return end
    return end + (start - end) * max(0.0, 1 - env_steps / decay_steps)
