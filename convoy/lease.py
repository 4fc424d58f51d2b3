"""The round lease: how a worker knows its round is still current before it writes any state.

The master hands out the epoch (the round id) and the lease term (its heartbeat timeout). Each
agent keeps one small file per node in shared memory, ``/dev/shm/convoy-<job>-lease-<node>``,
holding ``(round_id, valid_until)``: the round its workers run in and, on this host's monotonic
clock, until when the master cannot yet have declared the node lost (the last heartbeat's send
time plus the term, less a margin). The agent renews it on every heartbeat and zeroes it the
moment it learns its round ended. A worker's Checkpointer reads it before it commits a snapshot
or seals a checkpoint: an agent that was stopped (SIGSTOP) or cut off stops renewing, so its
workers stop writing state once the master may have moved on, even before the agent wakes up
and kills them. Torch-free: the agent and the workers both use it.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from convoy.shm import SHM_DIR, segment_prefix

LEASE_ENV = "CONVOY_LEASE"
"""Worker env: the path of the node's lease file (absent when not run by a convoy agent)."""
_FORMAT = struct.Struct("<8sqd")  # magic, round id (0: no current round), valid until (CLOCK_MONOTONIC)
_MAGIC = b"CVYLEAS1"
MARGIN = 0.2
"""Fraction of the term kept in hand, for the time a heartbeat takes to reach the master."""


def lease_path(job_id: str, node_id: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in node_id)
    return SHM_DIR / f"{segment_prefix(job_id)}lease-{safe}"


@dataclass(frozen=True)
class Lease:
    round_id: int
    valid_until: float

    def holds(self, round_id: int, now: float | None = None) -> bool:
        """Whether state of ``round_id`` may be written now."""
        now = time.monotonic() if now is None else now
        return self.round_id == round_id and now < self.valid_until


class LeaseWriter:
    """The agent's side: one file, rewritten in place with a single ``pwrite`` (readers never see half)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, _FORMAT.pack(_MAGIC, 0, 0.0), 0)
        except OSError:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def grant(self, round_id: int, sent_at: float, term_s: float) -> None:
        """The master heard from this node at about ``sent_at`` (monotonic) in ``round_id``."""
        self._write(round_id, sent_at + term_s * (1.0 - MARGIN))

    def revoke(self) -> None:
        """The round ended (or the agent stops): no worker of it may write state any more."""
        self._write(0, 0.0)

    def close(self) -> None:
        if self._fd is not None:
            self.revoke()
            os.close(self._fd)
            self._fd = None
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def _write(self, round_id: int, valid_until: float) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, _FORMAT.pack(_MAGIC, round_id, valid_until), 0)


def read_lease(path: Path | str | None = None) -> Lease | None:
    """The lease at ``path`` (default ``$CONVOY_LEASE``); None when there is none to honour
    (not started by a convoy agent). An unreadable or foreign file reads as revoked."""
    where = path if path is not None else os.environ.get(LEASE_ENV)
    if not where:
        return None
    try:
        with open(where, "rb") as handle:
            data = handle.read(_FORMAT.size)
    except FileNotFoundError:
        return Lease(0, 0.0)  # the agent removed it: its job or round is over
    if len(data) != _FORMAT.size:
        return Lease(0, 0.0)
    magic, round_id, valid_until = _FORMAT.unpack(data)
    return Lease(round_id, valid_until) if magic == _MAGIC else Lease(0, 0.0)
