"""n-step returns (no bootstrap past a true end, a bootstrap after a time limit) and double DQN's target."""

from __future__ import annotations

import pytest
import torch

from convoy.errors import ConfigError
from convoy.workloads.rl.dqn import double_dqn_loss, epsilon_at
from convoy.workloads.rl.nstep import NStep


def test_n_step_returns_and_discounts() -> None:
    nstep = NStep(3, 0.5)
    assert nstep.step(0, 0, 1.0, 1, False, False) == []
    assert nstep.step(1, 1, 2.0, 2, False, False) == []
    [first] = nstep.step(2, 0, 4.0, 3, False, False)
    assert (first.obs, first.reward, first.next_obs, first.discount) == (0, 1.0 + 0.5 * 2.0 + 0.25 * 4.0, 3, 0.125)
    ends = nstep.step(3, 1, 8.0, 4, True, False)  # the episode ends: the rest come out, none bootstraps
    assert [(t.obs, t.reward, t.next_obs, t.discount) for t in ends] == [
        (1, 2.0 + 0.5 * 4.0 + 0.25 * 8.0, 4, 0.0), (2, 4.0 + 0.5 * 8.0, 4, 0.0), (3, 8.0, 4, 0.0)]


def test_a_time_limit_still_bootstraps() -> None:
    nstep = NStep(3, 0.5)
    nstep.step(0, 0, 1.0, 1, False, False)
    cut = nstep.step(1, 0, 1.0, 2, False, True)
    assert [(t.obs, t.next_obs, t.discount) for t in cut] == [(0, 2, 0.25), (1, 2, 0.5)]
    with pytest.raises(ConfigError):
        NStep(0, 0.9)


def test_double_dqn_takes_the_online_choice_valued_by_the_target() -> None:
    online = torch.nn.Linear(2, 2, bias=False)
    target = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        online.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))  # picks action 1 on next_obs [1, 1]
        target.weight.copy_(torch.tensor([[10.0, 0.0], [0.0, 3.0]]))  # values action 1 at 3 (not the max, 10)
    batch = {"obs": torch.tensor([[1.0, 0.0]]), "action": torch.tensor([0]), "reward": torch.tensor([1.0]),
             "next_obs": torch.tensor([[1.0, 1.0]]), "discount": torch.tensor([0.5])}
    loss, td = double_dqn_loss(online, target, batch)
    assert torch.allclose(td, torch.tensor([abs(1.0 - (1.0 + 0.5 * 3.0))]))
    assert loss.item() > 0
    batch["discount"] = torch.tensor([0.0])  # past the end: no bootstrap
    _, td = double_dqn_loss(online, target, batch)
    assert torch.allclose(td, torch.tensor([0.0]))


def test_epsilon_decays_linearly_over_the_jobs_steps() -> None:
    assert epsilon_at(0, 1.0, 0.1, 100) == 1.0
    assert epsilon_at(50, 1.0, 0.1, 100) == pytest.approx(0.55)
    assert epsilon_at(500, 1.0, 0.1, 100) == 0.1
