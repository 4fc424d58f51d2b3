"""What the master's placement asks for capacity: a ``Scheduler``. The paths above it (placing a role's processes,
giving some back, growing again) do not branch on which one runs.

``Unbounded``: a job outside any pool (its nodes on several hosts): the nodes' own room is all there is, and no
one asks it to give anything back. ``PoolScheduler``: a job on this machine among others (``convoy run``'s local
nodes): room is what the pool's claims leave (``claims.room_for``: CPUs and memory), each grant taken at once in the
pool's file so two jobs cannot both take the same CPUs or bytes, and a job of higher priority that asks for more
than is free makes this one give back (``claims.give_back``). The Ray scheduler will answer by placing nodes.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

from convoy.control.pool.claims import Amount, Claim, PoolView, give_back, room_for
from convoy.control.pool.store import PoolStore


class Scheduler(Protocol):
    shared: bool
    """Whether other jobs share it (a claim to keep in sync)."""

    def take(self, need: Amount) -> bool:
        """Take ``need`` (CPUs and memory) for a process about to be placed; False: not free now (it waits)."""

    def room(self) -> Amount:
        """What this job could take now (where a role given back may grow again)."""

    def give_back(self) -> Amount:
        """What this job must give back now for a job of higher priority (nothing: none)."""

    def sync(self, held: Amount, floor: Amount, wants: Amount) -> None:
        """This job's numbers into the pool, and the pool's claims back (each a short transaction)."""

    def close(self) -> None:
        """The job has ended: its claim is withdrawn."""


class Unbounded:
    """No pool: every process fits (the nodes' room still applies), nothing is ever asked back."""

    shared = False
    """Whether other jobs share it (a claim to keep in sync)."""

    def take(self, need: Amount) -> bool:
        return True

    def room(self) -> Amount:
        return Amount(float("inf"), float("inf"))

    def give_back(self) -> Amount:
        return Amount()

    def sync(self, held: Amount, floor: Amount, wants: Amount) -> None:
        return None

    def close(self) -> None:
        return None


class PoolScheduler:
    """This job's claim in the machine's pool, and the pool as last read."""

    shared = True

    def __init__(self, store: PoolStore, job_id: str, priority: int, run_dir: str = "") -> None:
        self.store, self.job_id, self.priority, self.run_dir = store, job_id, priority, run_dir
        self.since = time.time()
        self.view = PoolView(store.capacity, ())
        self.taken = Amount()
        """Granted since the last sync (the pool's file holds it already; the view not yet)."""
        self.held = Amount()
        self.written: tuple[Amount, Amount, Amount] | None = None
        """The numbers last written to the pool."""

    def _claim(self, held: Amount, floor: Amount, wants: Amount) -> Claim:
        return Claim(self.job_id, self.priority, held, floor, wants, self.since, os.getpid(), self.run_dir)

    def take(self, need: Amount) -> bool:
        if not need.any():
            return True
        if not need.within(self.room()):
            return False
        granted = self.store.take(self._claim(self.held, Amount(), Amount()), need)
        if granted:
            self.taken = self.taken + need
        return granted

    def room(self) -> Amount:
        return (room_for(self.view, self.job_id, self.priority) - self.taken).clipped()

    def give_back(self) -> Amount:
        return give_back(self.view, self.job_id)

    def sync(self, held: Amount, floor: Amount, wants: Amount) -> None:
        """Written where it changed (a job that claims nothing writes nothing after its first tick); read always: what
        jobs of higher priority ask for must reach this one within a tick."""
        numbers = (held, floor, wants)
        if numbers != self.written or self.taken.any():
            self.store.put(self._claim(held, floor, wants))
            self.written = numbers
        self.view = self.store.view()
        self.held, self.taken = held, Amount()

    def close(self) -> None:
        self.store.remove(self.job_id)
