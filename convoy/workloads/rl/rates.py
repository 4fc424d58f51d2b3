"""What the replay buffer measures and, in throttle mode, enforces (pure: times are given, nothing sleeps).

``RateMeter`` turns the buffer's running counts into inserts and samples per second over a window. ``Throttle``
is the reference the rate-driven scaling is measured against: Reverb's ``SampleToInsertRatio`` rate limiter,
which holds samples per insert by making the faster side wait. An insert may go while
``inserts * target - samples`` stays at most ``offset + error``; a sample may go once ``min_size`` transitions are
in and while that quantity stays at least ``offset - error`` (``offset = min_size * target``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from convoy.errors import ConfigError


class RateMeter:
    """Running counts noted over time; ``rates`` gives the per-second change over the last ``window_s``."""

    def __init__(self, window_s: float = 2.0) -> None:
        if window_s <= 0:
            raise ConfigError(f"a rate window must be > 0 s, got {window_s}")
        self.window_s = window_s
        self._points: collections.deque[tuple[float, int, int]] = collections.deque()

    def note(self, now: float, inserted: int, sampled: int) -> None:
        self._points.append((now, inserted, sampled))
        while len(self._points) > 2 and now - self._points[1][0] >= self.window_s:
            self._points.popleft()

    def rates(self) -> tuple[float, float]:
        """(inserts per second, samples per second) over the window; zeros until two points span time."""
        if len(self._points) < 2:
            return 0.0, 0.0
        (t0, i0, s0), (t1, i1, s1) = self._points[0], self._points[-1]
        span = t1 - t0
        return ((i1 - i0) / span, (s1 - s0) / span) if span > 0 else (0.0, 0.0)


@dataclass(frozen=True)
class Throttle:
    target: float
    """Samples per insert to hold."""
    min_size: int = 1
    """Transitions in before the first sample may go."""
    error: float = 100.0
    """How far (in samples) the balance may stray either way before a side waits."""

    def __post_init__(self) -> None:
        if not self.target > 0:
            raise ConfigError(f"the throttle's target samples per insert must be > 0, got {self.target}")
        if self.min_size < 1 or self.error < 0:
            raise ConfigError("the throttle's min_size must be >= 1 and its error >= 0")

    def _balance(self, inserted: int, sampled: int) -> float:
        return inserted * self.target - sampled

    def may_insert(self, inserted: int, sampled: int, count: int) -> bool:
        """Whether ``count`` more inserts keep the balance within bounds (a first insert always goes)."""
        if inserted < self.min_size:
            return True
        return self._balance(inserted + count, sampled) <= self.min_size * self.target + self.error

    def may_sample(self, inserted: int, sampled: int, count: int) -> bool:
        if inserted < self.min_size:
            return False
        return self._balance(inserted, sampled + count) >= self.min_size * self.target - self.error
