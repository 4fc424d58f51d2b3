"""Transitions received by the replay service but not yet in its table (pure: tensors in, tensors out).

In scale mode the table takes in what the learners' samples allow at the target samples per insert, and the rest
waits here, in order, instead of making an actor wait: a learner group that stalls for a few seconds (a SIGSTOP, a
restart from its snapshot) leaves the ratio where it was, and the staged transitions enter as it samples again. What
scaling meets is the lasting difference between the rates; what staging absorbs is the moment.

Bounded to ``STAGE_S`` seconds of the table's intake (at least ``FLOOR`` rows, at most a quarter of its capacity):
staged transitions grow older while they wait, and a full staging means the actors are faster than the learners
with no scaling left to do (actors at their MIN, learners at their MAX, e.g. a cheap simulator), so an insert
that does not fit waits for room, counted as the service's insert wait: the throttle, as the last resort.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

Batch = dict[str, torch.Tensor]


STAGE_S = 10.0
"""Seconds of the table's intake that staging holds at most."""
FLOOR = 1024


@dataclass
class Staging:
    limit: int
    """Rows held at most (a batch that comes to an empty staging is taken whatever its size)."""
    batches: deque[tuple[str, Batch, int]] = field(default_factory=deque)
    rows: int = 0
    intakes: deque[tuple[float, float]] = field(default_factory=deque)
    """(time, rows per second the table took in), recent."""

    def fits(self, rows: int) -> bool:
        return self.rows == 0 or self.rows + rows <= self.limit

    def size_for(self, now: float, intake_per_s: float, capacity: int) -> None:
        """Hold ``STAGE_S`` seconds of the table's highest intake (rows per second) over the last ``3 STAGE_S``
        seconds (not of the intake now: while the learners stall the intake is 0, and that is when staging is
        needed), within ``[FLOOR, capacity / 4]``."""
        self.intakes.append((now, intake_per_s))
        while self.intakes and self.intakes[0][0] < now - 3 * STAGE_S:
            self.intakes.popleft()
        peak = max(intake for _, intake in self.intakes)
        if peak <= 0:  # no intake measured yet: as much room as it may ever have
            self.limit = max(1, capacity // 4)
            return
        self.limit = max(min(FLOOR, capacity // 4), min(capacity // 4, int(peak * STAGE_S)), 1)

    def push(self, source: str, batch: Batch, rows: int) -> None:
        if rows > 0:
            self.batches.append((source, batch, rows))
            self.rows += rows

    def take(self, rows: int) -> list[tuple[str, Batch, int]]:
        """The oldest ``rows`` rows (a batch cut where needed), in order, with their sources."""
        out: list[tuple[str, Batch, int]] = []
        while rows > 0 and self.batches:
            source, batch, count = self.batches[0]
            if count <= rows:
                self.batches.popleft()
                out.append((source, batch, count))
            else:
                out.append((source, {name: t[:rows] for name, t in batch.items()}, rows))
                self.batches[0] = (source, {name: t[rows:] for name, t in batch.items()}, count - rows)
                count = rows
            rows -= count
            self.rows -= count
        return out

    def due(self, inserted: int, sampled: int, target: float, slack: float) -> int:
        """Rows the table may take now: as many as keep ``sampled / inserted`` at ``target``, with ``slack`` samples
        of room (one learner batch)."""
        allowed = max(0, math.floor((sampled + slack) / target) - inserted) if target > 0 else self.rows
        return min(self.rows, allowed)
