"""The snapshot's overhead budget (``Checkpointer(max_overhead=0.02)``): which steps to snapshot so that the snapshots
cost the training at most that share of its time, taking every k-th step with the smallest k that does.

Pure: it is told the time between one ``Checkpointer.step()`` call and the next and whether the first of them took a
snapshot (that interval holds all of the snapshot's cost: the call's own work, the copy's contention with the next
step's compute and the optimizer's wait for it), and says whether the coming call takes one. What a snapshot costs
is the median interval with one less the median without; the decision is the same on every rank (the caller makes
the ranks agree on the largest k, at calls every rank counts alike).

Phases, by calls of ``step()``:
1. warm-up (``WARMUP`` calls): every step (the first snapshots allocate and fault in their buffers);
2. measuring (``MEASURE`` calls): every other step, so both kinds of interval are seen;
3. k chosen from the medians, and chosen again every ``RECHECK`` calls from the newest ``WINDOW`` intervals of
   each kind. At k = 1 no interval without a snapshot comes, so the last measured one stands in for the step's
   time until a larger k brings new ones.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from convoy.errors import CheckpointError

WARMUP = 3
MEASURE = 8
RECHECK = 50
WINDOW = 16


def every_for(cost_s: float, step_s: float, max_overhead: float) -> int:
    """The smallest k with ``cost_s / (k * step_s) <= max_overhead``: a snapshot every k-th step costs at most that
    share of the training's time (1 when a snapshot is free or the step's time is unknown)."""
    if cost_s <= 0 or step_s <= 0:
        return 1
    return max(1, math.ceil(cost_s / (max_overhead * step_s) - 1e-9))


def checked_budget(max_overhead: float | None) -> float | None:
    """``max_overhead`` as given, refused at once if it is no budget (a callback checks it where it is made, not at
    the start of training)."""
    if max_overhead is not None:
        SnapshotBudget(max_overhead)
    return max_overhead


@dataclass(frozen=True)
class Decision:
    every: int
    cost_s: float
    """A snapshot's measured cost: the median interval with one, less the median without."""
    step_s: float
    """The median interval without a snapshot."""
    max_overhead: float

    @property
    def overhead(self) -> float:
        """The share of the training's time the snapshots take at this k."""
        return max(self.cost_s, 0.0) / (self.every * self.step_s) if self.step_s > 0 else 0.0

    def describe(self) -> str:
        share = max(self.cost_s, 0.0) / self.step_s if self.step_s > 0 else 0.0
        return (f"snapshots every {self.every} step(s): one costs {1000 * max(self.cost_s, 0.0):.1f} ms of a "
                f"{1000 * self.step_s:.1f} ms step ({share:.1%}), so {self.overhead:.2%} of the training's time "
                f"(budget {self.max_overhead:.2%}); a failure may cost up to {self.every - 1} finished step(s)")


class SnapshotBudget:
    def __init__(self, max_overhead: float) -> None:
        if not 0 < max_overhead < 1:
            raise CheckpointError(f"max_overhead is the share of the step time snapshots may take, 0 < it < 1 (e.g. "
                                  f"0.02 for 2%), got {max_overhead}; None snapshots every step")
        self.max_overhead = max_overhead
        self.calls = 0
        """``step()`` calls so far (the same count on every rank)."""
        self.every = 1
        self.since = 0
        """Calls since the last snapshot of the steady phase."""
        self.with_snapshot: deque[float] = deque(maxlen=WINDOW)
        self.without: deque[float] = deque(maxlen=WINDOW)
        self.decision: Decision | None = None

    def observe(self, interval_s: float, snapshotted: bool) -> None:
        """The time from the last ``step()`` call to this one, and whether the last one took a snapshot."""
        if self.calls > WARMUP:  # the warm-up's first snapshots allocate their buffers: not what one costs
            (self.with_snapshot if snapshotted else self.without).append(interval_s)

    def due(self) -> bool:
        """Whether this ``step()`` call takes a snapshot (counts the call)."""
        self.calls += 1
        if self.calls <= WARMUP:
            return True
        if self.calls <= WARMUP + MEASURE:
            return (self.calls - WARMUP) % 2 == 1
        self.since += 1
        if self.since >= self.every:
            self.since = 0
            return True
        return False

    def deciding(self) -> bool:
        """Whether k is chosen at this call (after ``due``): the end of the measuring, then every ``RECHECK``."""
        steady = self.calls - WARMUP - MEASURE
        return steady == 0 or (steady > 0 and steady % RECHECK == 0)

    def propose(self) -> int:
        """This rank's k from its medians (the ranks then agree on the largest: ``settle``)."""
        if not self.without or not self.with_snapshot:
            return self.every
        step_s = statistics.median(self.without)
        return every_for(statistics.median(self.with_snapshot) - step_s, step_s, self.max_overhead)

    def settle(self, every: int) -> Decision | None:
        """Take ``every`` (agreed by the ranks); the new decision if k changed (or was first chosen), else None.
        ``decision`` stays the one last announced while k holds: what the events and status said is what it reads."""
        if self.decision is not None and every == self.every:
            return None
        step_s = statistics.median(self.without) if self.without else 0.0
        cost_s = statistics.median(self.with_snapshot) - step_s if self.with_snapshot and step_s else 0.0
        self.decision = Decision(every, cost_s, step_s, self.max_overhead)
        self.every = every
        return self.decision
