"""What each part of the master is given: the job, its settings and nodes, the master's lock, and how the events
of a call are recorded. ``JobMaster`` makes one and composes its parts (``RoleCalls``, ``TrainCalls``) around it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from convoy.config import MasterConfig
from convoy.control.job import RUNNING, Job
from convoy.control.nodes import NodeRegistry
from convoy.control.shards.master import PLAIN_ROLE


@dataclass(frozen=True)
class MasterCore:
    job: Job
    config: MasterConfig
    nodes: NodeRegistry
    changed: threading.Condition
    """The master's lock: every call holds it while it feeds the state machines; ``notify_all`` wakes the polls."""
    apply: Callable[..., None]
    """``apply(events, lazy_parts=False)``: record the events (the state file, the console, the long polls); called
    with the lock held (``lazy_parts``: ``Store.save``)."""

    @property
    def ended(self) -> bool:
        return self.job.status != RUNNING

    def stale(self, role_master: Any, role: str, rank: int, incarnation: int) -> str:
        """Why a call of process (``role``, ``rank``, ``incarnation``) comes from one that is no longer the job's:
        its job has ended, it no longer runs (a job of roles: ``role_master``), or it ran in another round (a plain
        job, whose processes' incarnation is their round); empty where it is current."""
        if self.ended:
            return f"job {self.job.job_id} has ended"
        if role_master is not None:
            return "" if role_master.is_running(role, rank, incarnation) else "is no longer running"
        if (role, incarnation) == (PLAIN_ROLE, self.job.round_id):
            return ""
        return f"ran in another round (round {incarnation}; the current round is {self.job.round_id})"
