"""n-step transitions from an actor's steps (pure Python: an actor feeds it one step at a time).

From steps ``(obs, action, reward, next_obs, terminated)`` it makes ``(obs_t, action_t, R, obs_{t+k}, discount)``
with ``R = r_t + gamma r_{t+1} + ... + gamma^(k-1) r_{t+k-1}`` and ``discount = gamma^k``, or 0 when the episode
terminated within those k steps (no bootstrap past a true end). A truncated episode (a time limit) still
bootstraps from its last observation: it did not end, it was cut.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from convoy.errors import ConfigError


@dataclass(frozen=True)
class Transition:
    obs: Any
    action: int
    reward: float
    next_obs: Any
    discount: float


class NStep:
    def __init__(self, n: int, gamma: float) -> None:
        if n < 1 or not 0 <= gamma <= 1:
            raise ConfigError(f"n-step needs n >= 1 and 0 <= gamma <= 1, got n={n}, gamma={gamma}")
        self.n, self.gamma = n, gamma
        self._window: deque[tuple[Any, int, float]] = deque()

    def step(self, obs: Any, action: int, reward: float, next_obs: Any, terminated: bool,
             truncated: bool) -> list[Transition]:
        """The transitions complete after this step (the episode's remaining ones once it ends)."""
        self._window.append((obs, action, reward))
        out: list[Transition] = []
        if len(self._window) == self.n:
            out.append(self._first(next_obs, terminated))
            self._window.popleft()
        if terminated or truncated:
            while self._window:
                out.append(self._first(next_obs, terminated))
                self._window.popleft()
        return out

    def _first(self, last_obs: Any, terminated: bool) -> Transition:
        """The transition of the window's oldest step, bootstrapping from ``last_obs``."""
        total, scale = 0.0, 1.0
        for _, _, reward in self._window:
            total += scale * reward
            scale *= self.gamma
        obs, action, _ = self._window[0]
        return Transition(obs, action, total, last_obs, 0.0 if terminated else scale)
