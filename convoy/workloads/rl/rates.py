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
    """Running counts noted over time; ``rates`` gives each one's per-second change over the last ``window_s``."""

    def __init__(self, window_s: float = 2.0) -> None:
        if window_s <= 0:
            raise ConfigError(f"a rate window must be > 0 s, got {window_s}")
        self.window_s = window_s
        self._points: collections.deque[tuple[float, tuple[int, ...]]] = collections.deque()

    def note(self, now: float, *counts: int) -> None:
        self._points.append((now, counts))
        while len(self._points) > 2 and now - self._points[1][0] >= self.window_s:
            self._points.popleft()

    def rates(self, how_many: int) -> tuple[float, ...]:
        """Each count's change per second over the window; zeros until two points span time."""
        if len(self._points) < 2:
            return (0.0,) * how_many
        (t0, first), (t1, last) = self._points[0], self._points[-1]
        span = t1 - t0
        if span <= 0:
            return (0.0,) * how_many
        return tuple((b - a) / span for a, b in zip(first, last, strict=True))


class Pacer:
    """Holds samples per insert without making anyone wait: each learner request of ``nominal`` transitions gets
    what the learners owe (``target`` per insert since pacing began, less what they sampled), kept within
    ``[nominal / 4, 4 nominal]``. A learner ahead trains on smaller batches, one behind (after a stall) on larger
    ones until it has caught up; the controller's scaling keeps the owed amount near ``nominal``."""

    LOW, HIGH = 0.25, 4.0

    def __init__(self) -> None:
        self.base: tuple[int, int] | None = None
        """(inserted, sampled) when pacing began (the first paced request: learning starts)."""

    def count(self, target: float, nominal: int, inserted: int, sampled: int) -> int:
        if not target > 0 or nominal < 1:
            raise ConfigError(f"pacing needs a target > 0 and a count >= 1, got {target} and {nominal}")
        if self.base is None:
            self.base = (inserted, sampled)
        owed = target * (inserted - self.base[0]) - (sampled - self.base[1])
        low, high = max(1, int(nominal * self.LOW)), int(nominal * self.HIGH)
        return max(low, min(high, round(owed)))


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

    def check(self, count: int, inserting: bool, inserted: int) -> None:
        """A ConfigError for a request no balance in the band lets through (it would wait for ever): ``count``
        inserts move the balance by ``count * target``, ``count`` samples by ``count``, the band is ``2 * error``
        (inserts before ``min_size`` go whatever their size)."""
        if inserting and inserted < self.min_size:
            return
        moves = count * self.target if inserting else count
        if moves > 2 * self.error:
            side = f"an insert of {count}" if inserting else f"a sample of {count}"
            raise ConfigError(f"the throttle's band ({2 * self.error:g} samples wide) can never let {side} through: "
                              f"raise throttle_error to at least {moves / 2:g} or send smaller batches")

    def may_sample(self, inserted: int, sampled: int, count: int) -> bool:
        if inserted < self.min_size:
            return False
        return self._balance(inserted, sampled + count) >= self.min_size * self.target - self.error
