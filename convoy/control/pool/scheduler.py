"""What the master's placement asks for capacity: a ``Scheduler``. The paths above it (placing a role's processes,
giving some back, growing again) do not branch on which one runs.

``Unbounded``: a job outside any pool (its nodes on several hosts): the nodes' own room is all there is, and no
one asks it to give anything back. ``PoolScheduler``: a job on this machine among others (``convoy run``'s local
nodes): room is what the pool's claims leave (``claims.room_for``), each grant taken at once in the pool's file so
two jobs cannot both take the same CPUs, and a job of higher priority that asks for more than is free makes this
one give back (``claims.give_back``). The Ray scheduler will answer by placing nodes.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

from convoy.control.pool.claims import EPSILON, Claim, PoolView, give_back, room_for
from convoy.control.pool.store import PoolStore


class Scheduler(Protocol):
    def take(self, cpus: float) -> bool:
        """Take ``cpus`` for a process about to be placed; False: not free now (it waits)."""

    def room(self) -> float:
        """CPUs this job could take now (where a role given back may grow again)."""

    def give_back(self) -> float:
        """CPUs this job must give back now for a job of higher priority (0: none)."""

    def sync(self, held: float, floor: float, wants: float) -> None:
        """This job's numbers into the pool, and the pool's claims back (each a short transaction)."""

    def close(self) -> None:
        """The job has ended: its claim is withdrawn."""


class Unbounded:
    """No pool: every process fits (the nodes' room still applies), nothing is ever asked back."""

    def take(self, cpus: float) -> bool:
        return True

    def room(self) -> float:
        return float("inf")

    def give_back(self) -> float:
        return 0.0

    def sync(self, held: float, floor: float, wants: float) -> None:
        return None

    def close(self) -> None:
        return None


class PoolScheduler:
    """This job's claim in the machine's pool, and the pool as last read."""

    def __init__(self, store: PoolStore, job_id: str, priority: int, run_dir: str = "") -> None:
        self.store, self.job_id, self.priority, self.run_dir = store, job_id, priority, run_dir
        self.since = time.time()
        self.view = PoolView(store.capacity, ())
        self.taken = 0.0
        """CPUs granted since the last sync (the pool's file holds them already; the view not yet)."""
        self.held = 0.0

    def _claim(self, held: float, floor: float, wants: float) -> Claim:
        return Claim(self.job_id, self.priority, held, floor, wants, self.since, os.getpid(), self.run_dir)

    def take(self, cpus: float) -> bool:
        if cpus <= EPSILON:
            return True
        if room_for(self.view, self.job_id, self.priority) - self.taken < cpus - EPSILON:
            return False
        granted = self.store.take(self._claim(self.held, 0.0, 0.0), cpus)
        if granted:
            self.taken += cpus
        return granted

    def room(self) -> float:
        return room_for(self.view, self.job_id, self.priority) - self.taken

    def give_back(self) -> float:
        return give_back(self.view, self.job_id)

    def sync(self, held: float, floor: float, wants: float) -> None:
        self.view = self.store.sync(self._claim(held, floor, wants))
        self.held, self.taken = held, 0.0

    def close(self) -> None:
        self.store.remove(self.job_id)
