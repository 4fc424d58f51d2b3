"""Environments for the RL job: a gymnasium environment by id, its state space cut into slices of reset seeds, and
``step_cost``: seconds each step takes, standing for an expensive simulator (it sleeps, so a 2-core machine can
show what more actors buy)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from convoy.errors import ConfigError
from convoy.workloads.rl.slices import Slice, check_cover, seed_slices


def make(env_id: str) -> Any:
    """``gymnasium.make(env_id)``; an id gymnasium does not know is one line naming it and some that exist."""
    try:
        import gymnasium
    except ImportError as exc:
        raise ConfigError("the RL workload needs gymnasium: pip install 'convoy[rl]'") from exc
    try:
        return gymnasium.make(env_id)
    except gymnasium.error.Error as exc:
        known = [name for name in ("CartPole-v1", "Acrobot-v1", "LunarLander-v3", "MountainCar-v0")
                 if name in gymnasium.registry]
        raise ConfigError(f"environment {env_id!r} does not exist in gymnasium ({exc}); e.g. {', '.join(known)}") \
            from exc


@dataclass(frozen=True)
class EnvSpec:
    """What the learners and actors agree on: observation size and action count of a discrete-action env."""

    obs_size: int
    actions: int

    @staticmethod
    def of(env: Any) -> EnvSpec:
        space, actions = env.observation_space, env.action_space
        if getattr(space, "shape", None) is None or len(space.shape) != 1 or not hasattr(actions, "n"):
            raise ConfigError(f"{env.spec.id if env.spec else env}: the DQN job takes a vector observation and "
                              "discrete actions")
        return EnvSpec(int(space.shape[0]), int(actions.n))


class SlicedEnv:
    """One actor's environment: each episode resets with the next seed of the actor's next slice (round robin), and
    each step sleeps ``step_cost`` seconds first. ``visits`` counts episodes per slice."""

    def __init__(self, env_id: str, slices: list[Slice], step_cost: float = 0.0) -> None:
        self.env = make(env_id)
        self.spec = EnvSpec.of(self.env)
        self.slices = {s.index: s for s in slices}
        self.owned: list[int] = []
        self.step_cost = step_cost
        self.visits: dict[int, int] = {}
        self._turn = 0
        self._episodes: dict[int, int] = {}

    def own(self, indices: list[int]) -> None:
        unknown = [i for i in indices if i not in self.slices]
        if unknown:
            raise ConfigError(f"slices {unknown} are not in this environment's {len(self.slices)} slices")
        self.owned = sorted(indices)

    def reset(self) -> tuple[Any, int]:
        """(observation, slice index) of a new episode; an actor that owns no slice yet uses slice 0."""
        index = self.owned[self._turn % len(self.owned)] if self.owned else 0
        self._turn += 1
        episode = self._episodes.get(index, 0)
        self._episodes[index] = episode + 1
        self.visits[index] = self.visits.get(index, 0) + 1
        obs, _ = self.env.reset(seed=self.slices[index].seed(episode))
        return obs, index

    def step(self, action: int) -> tuple[Any, float, bool, bool]:
        if self.step_cost > 0:
            time.sleep(self.step_cost)
        obs, reward, terminated, truncated, _ = self.env.step(action)
        return obs, float(reward), bool(terminated), bool(truncated)

    def take_visits(self) -> dict[int, int]:
        visits, self.visits = self.visits, {}
        return visits

    def close(self) -> None:
        self.env.close()


def slices_for(seeds: int, count: int) -> list[Slice]:
    """The default cut: ``seeds`` reset seeds in ``count`` even slices (checked to tile the space)."""
    slices = seed_slices(seeds, count)
    check_cover(slices, seeds)
    return slices
