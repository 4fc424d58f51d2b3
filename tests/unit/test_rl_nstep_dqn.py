"""n-step returns (no bootstrap past a true end, a bootstrap after a time limit), double DQN's target, and a short
learning check of the pieces together."""

from __future__ import annotations

import copy

import pytest
import torch

from convoy.errors import ConfigError
from convoy.workloads.rl.actor import to_batch
from convoy.workloads.rl.buffer import Layout, ReplayBuffer
from convoy.workloads.rl.dqn import double_dqn_loss, epsilon_at, greedy_or_random, q_network
from convoy.workloads.rl.envs import SlicedEnv, slices_for
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


def test_the_pieces_learn_cartpole_in_six_thousand_steps() -> None:
    """The learning check: the actor's and the learner's pieces in one process (sliced environment, 3-step
    transitions, the buffer, epsilon-greedy, double DQN with a target network), seeded: the last 20 episodes of
    6,000 steps average far above a random policy's 22 (this run: about 220)."""
    pytest.importorskip("gymnasium")
    torch.manual_seed(0)
    env = SlicedEnv("CartPole-v1", slices_for(100, 4))
    env.own([0, 1, 2, 3])
    online = q_network(4, 2, 64)
    target = copy.deepcopy(online)
    optimizer = torch.optim.Adam(online.parameters(), lr=1e-3)
    buffer = ReplayBuffer(Layout.for_dqn((4,)), 20_000, alpha=0.0, seed=0)
    generator = torch.Generator().manual_seed(0)
    returns: list[float] = []
    steps = updates = 0
    while steps < 6000:
        obs, _ = env.reset()
        nstep, total, done = NStep(3, 0.99), 0.0, False
        while not done:
            with torch.no_grad():
                action = greedy_or_random(online(torch.as_tensor(obs, dtype=torch.float32)),
                                          epsilon_at(steps, 1.0, 0.05, 2000), generator)
            next_obs, reward, terminated, truncated = env.step(action)
            total, steps = total + reward, steps + 1
            finished = nstep.step(obs.tolist(), action, reward, next_obs.tolist(), terminated, truncated)
            if finished:
                buffer.insert(to_batch(finished))
            obs, done = next_obs, terminated or truncated
            if buffer.size >= 500:
                loss, _ = double_dqn_loss(online, target, buffer.sample(64).batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                updates += 1
                if updates % 50 == 0:
                    target.load_state_dict(online.state_dict())
        returns.append(total)
    assert sum(returns[-20:]) / 20 > 150, returns[-20:]
