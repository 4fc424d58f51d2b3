"""The sample store's state (pure): groups of responses in, by the policy version that made them, out to the
trainers under the staleness rule, every group counted by version and by what became of it.

A group is one prompt's responses, made by one rollout with one version of the weights (GRPO's advantages are
relative within it, so a group is stored, taken and dropped whole). The rule: a trainer at version ``current`` takes
only groups made by versions >= ``current - max_lag`` (``max_lag`` 0: synchronous, >= 1: asynchronous); older ones
are dropped when found and counted, never handed out. A group from a version no trainer has published yet, or with
no room left, is refused and counted; the rollout that sent it is told which.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from convoy.errors import ConfigError

KEPT, STALE, UNKNOWN, FULL = "kept", "stale", "unknown version", "full"


@dataclass
class VersionCounts:
    """What became of the groups one version made."""

    put: int = 0
    taken: int = 0
    dropped_stale: int = 0
    refused_full: int = 0


@dataclass
class Stored:
    """One group in the store: who made it and what it holds (opaque here)."""

    version: int
    source: str
    payload: Any


@dataclass
class SampleStore:
    """``capacity`` groups at most; ``max_lag``: k of the staleness rule."""

    capacity: int
    max_lag: int
    published: int = 0
    """The newest version the trainers have published (a group claims at most this one)."""
    groups: deque[Stored] = field(default_factory=deque)
    by_version: dict[int, VersionCounts] = field(default_factory=dict)
    refused_unknown: int = 0
    taken_now: int = 0
    """Groups the trainers' step at the published version has taken (a step at version v takes with current = v)."""

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ConfigError(f"the sample store's capacity must be >= 1 group, got {self.capacity}")
        if self.max_lag < 0:
            raise ConfigError(f"max_lag (k) must be >= 0 (0: synchronous, >= 1: asynchronous), got {self.max_lag}")

    def _counts(self, version: int) -> VersionCounts:
        return self.by_version.setdefault(version, VersionCounts())

    def publish(self, version: int) -> None:
        """The trainers' weights reached ``version`` (versions only grow)."""
        if version < self.published:
            raise ConfigError(f"version {version} is older than the published {self.published}: versions only grow")
        if version > self.published:
            self.taken_now = 0
        self.published = version

    def put(self, version: int, payload: Any, source: str = "") -> str:
        """Keep one group made by ``version``; ``KEPT``, or why not (``STALE``, ``UNKNOWN``, ``FULL``)."""
        if version > self.published or version < 0:
            self.refused_unknown += 1
            return UNKNOWN
        counts = self._counts(version)
        if version < self.published - self.max_lag:
            counts.put += 1
            counts.dropped_stale += 1
            return STALE
        if len(self.groups) >= self.capacity:
            self._drop_stale(self.published)
        if len(self.groups) >= self.capacity:
            counts.refused_full += 1
            return FULL
        counts.put += 1
        self.groups.append(Stored(version, source, payload))
        return KEPT

    def take(self, count: int, current: int) -> list[Stored]:
        """Up to ``count`` groups, oldest first, each made by a version >= ``current - max_lag``; older ones found on
        the way are dropped and counted."""
        if count < 1:
            raise ConfigError(f"take at least one group, got {count}")
        if current > self.published:
            self.publish(current)
        self._drop_stale(current)
        taken = []
        while self.groups and len(taken) < count:
            group = self.groups.popleft()
            self._counts(group.version).taken += 1
            taken.append(group)
        if current == self.published:
            self.taken_now += len(taken)
        return taken

    def fresh(self) -> int:
        """Groups held that a trainer at the published version may still take."""
        return sum(1 for group in self.groups if group.version >= self.published - self.max_lag)

    def _drop_stale(self, current: int) -> None:
        fresh: deque[Stored] = deque()
        for group in self.groups:
            if group.version >= current - self.max_lag:
                fresh.append(group)
            else:
                self._counts(group.version).dropped_stale += 1
        self.groups = fresh

    def stats(self) -> dict[str, Any]:
        totals = VersionCounts()
        for counts in self.by_version.values():
            totals.put += counts.put
            totals.taken += counts.taken
            totals.dropped_stale += counts.dropped_stale
            totals.refused_full += counts.refused_full
        return {"held": len(self.groups), "capacity": self.capacity, "max_lag": self.max_lag,
                "published": self.published, "put": totals.put, "taken": totals.taken,
                "dropped_stale": totals.dropped_stale, "refused_full": totals.refused_full,
                "refused_unknown": self.refused_unknown,
                "by_version": {str(v): vars(c).copy() for v, c in sorted(self.by_version.items())}}
