"""Per-source budgets that keep a chatty or hostile client from flooding the job's record."""

from __future__ import annotations

from dataclasses import dataclass

WORKER_EVENTS_PER_WINDOW = 20
WORKER_EVENT_WINDOW_S = 10.0
MAX_SOURCES = 1024
"""Sources remembered at once; those idle for a whole window are forgotten first."""


@dataclass
class EventBudget:
    """At most ``limit`` records per ``window_s``; the rest are only counted, and the count goes
    with the next record that is let through."""

    window_start: float
    limit: int = WORKER_EVENTS_PER_WINDOW
    window_s: float = WORKER_EVENT_WINDOW_S
    recorded: int = 0
    dropped: int = 0

    def admit(self, now: float) -> int | None:
        """None if this one is over budget (counted); else how many were dropped before it."""
        if now - self.window_start >= self.window_s:
            self.window_start, self.recorded = now, 0
        if self.recorded >= self.limit:
            self.dropped += 1
            return None
        self.recorded += 1
        dropped, self.dropped = self.dropped, 0
        return dropped


def budget_for(budgets: dict[str, EventBudget], source: str, now: float) -> EventBudget:
    """The budget of ``source``, made if new; the table stays bounded by forgetting idle sources."""
    budget = budgets.get(source)
    if budget is None:
        if len(budgets) >= MAX_SOURCES:
            idle = [s for s, b in budgets.items() if now - b.window_start >= b.window_s and not b.dropped]
            for stale in idle or list(budgets)[: len(budgets) // 2]:
                del budgets[stale]
        budget = budgets[source] = EventBudget(now)
    return budget
