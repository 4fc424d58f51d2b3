"""The worker's side of the round lease: may this worker still commit state of its round?

Read before a snapshot slot is committed and before a persistent save starts or is sealed. A
worker not started by a convoy agent (plain python, torchrun) has no lease and is never
fenced. A refusal is said once per reason and recorded as an event; training goes on, since the
agent stops this worker as soon as it learns its round ended, and a worker whose lease ran out
stops itself (``convoy/worker/lease_watch.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Protocol

from convoy.worker import events as worker_events
from convoy.worker.lease import LEASE_ENV, lease_clock, own_round, read_lease


class Fence(Protocol):
    """What the snapshot and persistent protocols ask before they commit (``RoundFence``, or a test's script)."""

    def allows(self, what: str) -> bool: ...


class RoundFence:
    """One worker's check against its node's lease (one small read of a tmpfs file per call)."""

    def __init__(self, say: Callable[[str], None], lease_file: str | Path | None = None,
                 round_id: int | None = None) -> None:
        self.lease_file = lease_file if lease_file is not None else os.environ.get(LEASE_ENV) or None
        self.round_id = round_id if round_id is not None else own_round()
        """This worker's round (None: a process that lives across rounds, which any current round's lease lets
        write)."""
        self.say = say
        self.refused: dict[str, str] = {}
        """Each reason refused so far (``stale_round``, ``lease_lapsed``) and the first message said for it."""

    def allows(self, what: str) -> bool:
        """Whether ``what`` (e.g. "snapshot of step 7") may be committed now; says why not, once per reason."""
        if self.lease_file is None:
            return True
        lease = read_lease(self.lease_file)
        now = lease_clock()
        if lease is None or lease.holds(self.round_id, now):
            return True
        if lease.of(self.round_id):
            self._refuse("lease_lapsed", f"round lease lapsed (the agent's last answer from the master is nearly "
                         f"a heartbeat timeout old, so the master may declare this node lost; lapsed "
                         f"{now - lease.valid_until:.1f} s ago): not committing {what} until it is renewed")
        else:
            ended = f"round {self.round_id} is no longer current" if self.round_id is not None else \
                "this node runs no round of the job any more"
            self._refuse("stale_round", f"{ended}: {what} not committed; the agent will stop this worker")
        return False

    def _refuse(self, reason: str, message: str) -> None:
        if reason in self.refused:
            return
        self.refused[reason] = message
        self.say(message)
        worker_events.emit(reason, message)
