"""What each part of the master is given: the job, its settings and nodes, the master's lock, and how the events
of a call are recorded. ``JobMaster`` makes one and composes its parts (``RoleCalls``, ``TrainCalls``) around it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from convoy.config import MasterConfig
from convoy.control.job import RUNNING, Event, Job
from convoy.control.nodes import NodeRegistry


@dataclass(frozen=True)
class MasterCore:
    job: Job
    config: MasterConfig
    nodes: NodeRegistry
    changed: threading.Condition
    """The master's lock: every call holds it while it feeds the state machines; ``notify_all`` wakes the polls."""
    apply: Callable[[list[Event]], None]
    """Record the events (the state file, the console, the long polls); called with the lock held."""

    @property
    def ended(self) -> bool:
        return self.job.status != RUNNING
