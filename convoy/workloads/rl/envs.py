"""Environments for the RL job: a gymnasium environment by id, its state space cut into slices, and ``step_cost``:
seconds each step takes, standing for an expensive simulator (it sleeps, so a 2-core machine can show what more
actors buy).

Slices are ranges of reset seeds by default (any environment), or boxes of initial states (``slicing =
"start-boxes"``) for an environment that declares its box: gymnasium's CartPole, Acrobot and MountainCar are known
here, and any environment may declare its own with a method ``convoy_start_box()`` on its unwrapped class that
returns ``(low, high, axis)``: the box of its initial states and the axis to cut it along (its ``state`` attribute is
set to a point of the box after each reset)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from convoy.errors import ConfigError
from convoy.workloads.rl.slices import Slice, StartBox, box_slices, check_boxes, check_cover, seed_slices

START_BOXES: dict[str, tuple[tuple[float, ...], tuple[float, ...], int]] = {
    "CartPole-v1": ((-0.05,) * 4, (0.05,) * 4, 2),  # cut along the pole's angle
    "Acrobot-v1": ((-0.1,) * 4, (0.1,) * 4, 0),  # along the first link's angle
    "MountainCar-v0": ((-0.6, 0.0), (-0.4, 0.0), 0),  # along the car's position
}
"""Boxes of initial states as gymnasium draws them (low, high, the axis to cut along)."""


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


def start_box(env: Any) -> tuple[tuple[float, ...], tuple[float, ...], int]:
    """The environment's own declaration of its box of initial states, else the known one; a ConfigError for an
    environment that has none."""
    declared = getattr(env.unwrapped, "convoy_start_box", None)
    if declared is not None:
        low, high, axis = declared()
        return tuple(float(x) for x in low), tuple(float(x) for x in high), int(axis)
    env_id = env.spec.id if env.spec else str(env)
    if env_id not in START_BOXES:
        raise ConfigError(f"{env_id} declares no box of initial states (no convoy_start_box() method; known: "
                          f"{', '.join(START_BOXES)}): use slicing = \"seeds\"")
    return START_BOXES[env_id]


def declare_slices(env: Any, slicing: str, count: int, seeds: int) -> list[Slice] | list[StartBox]:
    """The environment's state space as ``count`` slices, checked to tile it."""
    if slicing == "start-boxes":
        low, high, axis = start_box(env)
        boxes = box_slices(low, high, axis, count)
        check_boxes(boxes, low, high)
        return boxes
    return slices_for(seeds, count)


class SlicedEnv:
    """One actor's environment: each episode starts in the actor's next slice (round robin): from the slice's next
    reset seed, or from a state drawn in its start box. Each step sleeps ``step_cost`` seconds first. ``visits``
    counts episodes per slice."""

    def __init__(self, env_id: str, slices: list[Slice] | list[StartBox] | None = None, step_cost: float = 0.0,
                 slicing: str = "seeds", count: int = 16, seeds: int = 10_000) -> None:
        self.env = make(env_id)
        if slices is None:
            slices = declare_slices(self.env, slicing, count, seeds)
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
        piece = self.slices[index]
        if isinstance(piece, Slice):
            obs, _ = self.env.reset(seed=piece.seed(episode))
            return obs, index
        obs, _ = self.env.reset(seed=index * 1_000_003 + episode)
        state = piece.draw(random.Random(index * 1_000_003 + episode))
        inner = self.env.unwrapped
        inner.state = np.array(state, dtype=np.asarray(inner.state).dtype)
        observe = getattr(inner, "_get_ob", None)  # where the observation is not the state itself (Acrobot)
        obs = observe() if observe is not None else np.array(state, dtype=np.float32)
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
