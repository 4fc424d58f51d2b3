"""Long polls held without a thread each: a ``/wait`` or ``/heartbeat`` with nothing to say yet is parked here with
its connection, and handed back to the handler pool when the job's state moves or its time is up. One thread
watches them all, woken by the master's condition (every change notifies it).

A sweep looks at the parked polls only when the master's ``epoch`` (what they wait on: the round, the job's status,
the versions pushed to the nodes) differs from the last sweep's, so the joins of a thousand nodes cost a look at
one value each, not at every parked poll."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

IDLE_LOOK_S = 1.0
"""The longest the watcher sleeps without a deadline or a change (a bound, not how it is woken)."""
URGENT = -1
"""The handler pool's priority of a poll found ready and ``urgent``: before every other."""


@dataclass
class LongPoll:
    """What a call returns instead of its answer when it has nothing to say yet: its handler thread goes back to
    the pool, and ``answer`` runs on one when ``ready()`` (read under the master's lock) or at ``deadline``."""

    ready: Callable[[], bool]
    deadline: float
    """Monotonic seconds."""
    answer: Callable[[], Any]
    priority: int = 1
    """As the handler pool's: lower first (heartbeats are 0)."""
    urgent: Callable[[], bool] | None = None
    """Read under the master's lock when the poll is found ready: True answers it before the others (``URGENT``). A
    heartbeat that carries orders goes before those that carry only a new round: when a node is lost at 4096 nodes,
    its process's new home hears of it ahead of the 4095 told of the round, not after half of them."""
    resume: Callable[[], None] | None = field(default=None, repr=False)
    """Set when parked: hands the poll back to the pool (once)."""
    done: bool = False


class LongPolls:
    """The parked polls of one master; ``changed`` is the master's condition, held while ``ready`` is read."""

    def __init__(self, changed: threading.Condition, epoch: Callable[[], object]) -> None:
        self._changed, self._epoch = changed, epoch
        self._parked: dict[int, LongPoll] = {}
        self._deadlines: list[tuple[float, int, LongPoll]] = []
        self._order = itertools.count()
        self._seen: object = None
        self._wakes_at = 0.0
        """When the sleeping watcher looks next at the latest (a poll due sooner wakes it)."""
        self._stopping = False
        self._thread = threading.Thread(target=self._watch, name="convoy-long-polls", daemon=True)
        self.resumed = 0

    @property
    def parked(self) -> int:
        return len(self._parked)

    def start(self) -> None:
        self._thread.start()

    def park(self, poll: LongPoll, resume: Callable[[], None]) -> None:
        """Hold ``poll`` until it is ready or due; ``resume`` then hands it to a thread. A poll that became ready
        between its call and here (the state moved in between) goes back at once."""
        poll.resume = resume
        with self._changed:
            now = self._stopping or poll.ready()
            if not now:
                key = next(self._order)
                self._parked[key] = poll
                heapq.heappush(self._deadlines, (poll.deadline, key, poll))
                if poll.deadline < self._wakes_at:  # the watcher would sleep past it
                    self._changed.notify_all()
        if now:
            self._hand_back([poll])

    def stop(self) -> None:
        """Every parked poll is answered (the master's stop: they say so), and the watcher ends."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._thread.is_alive():
            self._thread.join(5)

    def _watch(self) -> None:
        with self._changed:
            while True:
                due = self._sweep(time.monotonic())
                if self._stopping:
                    due += [self._parked.pop(key) for key in list(self._parked)]
                if due:  # handed back without the master's lock; a change meanwhile moves the epoch: swept again
                    self._changed.release()
                    try:
                        self._hand_back(due)
                    finally:
                        self._changed.acquire()
                    continue
                if self._stopping:
                    return
                next_due = self._deadlines[0][0] if self._deadlines else float("inf")
                now = time.monotonic()
                self._wakes_at = min(now + IDLE_LOOK_S, next_due)
                self._changed.wait(max(0.0, self._wakes_at - now))

    def _sweep(self, now: float) -> list[LongPoll]:
        """The polls due or ready now, taken out (the caller holds the lock)."""
        due = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key, poll = heapq.heappop(self._deadlines)
            if self._parked.pop(key, None) is not None:
                due.append(poll)
        epoch = self._epoch()
        if epoch != self._seen:
            self._seen = epoch
            ready = [self._parked.pop(key) for key, poll in list(self._parked.items()) if poll.ready()]
            for poll in ready:
                if poll.urgent is not None and poll.urgent():
                    poll.priority = URGENT
            due += ready
        return due

    def _hand_back(self, polls: list[LongPoll]) -> None:
        for poll in polls:
            if poll.done or poll.resume is None:
                continue
            poll.done = True
            self.resumed += 1
            # dropped before it runs: it holds the poll's handler, and the handler the poll (a cycle, left to the
            # master's rare full collections, held thousands of answered polls: 200 MB at 4096 nodes)
            resume, poll.resume = poll.resume, None
            resume()
