"""The round lease: how a worker knows its round is still current, before it writes state and while it runs.

The master hands out the epoch (the round id) and the lease term (its heartbeat timeout). Each
agent keeps one small file per node in shared memory, ``/dev/shm/convoy-<job>-lease-<node>``,
holding ``(round_id, valid_until, expires_at)`` on this host's CLOCK_BOOTTIME (``lease_clock``: one clock
for every process of the host, so the agent's times mean the same to its workers, and one that counts
time the host spent suspended, as the master's clock elsewhere does):

- ``valid_until``: until when the master cannot yet have declared the node lost (the send time of
  the heartbeat it answered, plus the term, less a margin). A worker's Checkpointer commits no
  snapshot or checkpoint after it (``runtime/fence.py``).
- ``expires_at``: one term after the agent last heard from the master, the master's own rule for a
  lost node seen from the node's side. A worker still running then stops itself
  (``lease_watch.py``). A healthy agent hears from the master every heartbeat interval (a long
  poll, shorter than the term by the config's check), so only an answer late by most of a term, the
  master's sign of a lost node too, lets it expire.

The agent renews the lease on every answer of the master and zeroes it the moment it learns its round
ended; an agent that was stopped (SIGSTOP) or cut off stops renewing, so its workers stop writing
state, then stop altogether, even before the agent wakes up and kills them. Torch-free: the agent and
the workers both use it.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from convoy.shm import SHM_DIR, segment_prefix

LEASE_ENV = "CONVOY_LEASE"
"""Worker env: the path of the node's lease file (absent when not run by a convoy agent)."""
ROUND_ENV = "CONVOY_ROUND"
_BODY = struct.Struct("<8sqdd")  # magic, round id (0: no current round), valid until, expires at
_CHECK = struct.Struct("<I")  # crc32 of the body: a read torn by a concurrent rewrite is seen and read again
_MAGIC = b"CVYLEAS2"
_READ_TRIES = 5
_CLOCK = getattr(time, "CLOCK_BOOTTIME", None)
MARGIN = 0.2
"""Fraction of the term kept in hand before ``valid_until``: a commit under way has time to finish before the
master may move on."""


def lease_clock() -> float:
    """Seconds on the lease's clock (CLOCK_BOOTTIME where there is one; a node that slept through its term must
    not wake up holding its lease, as it would on CLOCK_MONOTONIC)."""
    return time.clock_gettime(_CLOCK) if _CLOCK is not None else time.monotonic()


def own_round(environ: Mapping[str, str] = os.environ) -> int | None:
    """The round this process runs in (``CONVOY_ROUND``); None for a process that lives across its job's rounds
    (a role process), to which any current round's lease counts."""
    try:
        return int(environ[ROUND_ENV])
    except (KeyError, ValueError):
        return None


def lease_path(job_id: str, node_id: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in node_id)
    return SHM_DIR / f"{segment_prefix(job_id)}lease-{safe}"


@dataclass(frozen=True)
class Lease:
    round_id: int
    valid_until: float
    expires_at: float = 0.0

    def of(self, round_id: int | None) -> bool:
        """Whether this is a lease of ``round_id`` (None: of whichever round is current, as for a role process,
        which lives across the rounds of its job)."""
        return self.round_id != 0 and (round_id is None or self.round_id == round_id)

    def holds(self, round_id: int | None, now: float | None = None) -> bool:
        """Whether state of ``round_id`` may be written now (``now`` on ``lease_clock``)."""
        now = lease_clock() if now is None else now
        return self.of(round_id) and now < self.valid_until

    def expired(self, round_id: int | None, now: float | None = None) -> bool:
        """Whether a process of ``round_id`` must stop now: its round's lease ran a whole term without news from
        the master. A revoked lease or one of another round has not expired: the agent that ended the round is
        alive, and stops its processes itself."""
        now = lease_clock() if now is None else now
        return self.of(round_id) and now >= self.expires_at


class LeaseWriter:
    """The agent's side: one file, rewritten in place with a single ``pwrite``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, _record(0, 0.0, 0.0), 0)
        except OSError:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def grant(self, round_id: int, sent_at: float, term_s: float) -> None:
        """The master answered, now, a request this node sent at ``sent_at`` (``time.monotonic``, as the agent
        times its requests) in ``round_id``."""
        now = lease_clock()
        sent = sent_at + (now - time.monotonic())  # on the lease's clock
        self._write(round_id, sent + term_s * (1.0 - MARGIN), now + term_s)

    def revoke(self) -> None:
        """The round ended (or the agent stops): no worker of it may write state any more."""
        self._write(0, 0.0, 0.0)

    def close(self) -> None:
        if self._fd is not None:
            self.revoke()
            os.close(self._fd)
            self._fd = None
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def _write(self, round_id: int, valid_until: float, expires_at: float) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, _record(round_id, valid_until, expires_at), 0)


def _record(round_id: int, valid_until: float, expires_at: float) -> bytes:
    body = _BODY.pack(_MAGIC, round_id, valid_until, expires_at)
    return body + _CHECK.pack(zlib.crc32(body))


def read_lease(path: Path | str | None = None) -> Lease | None:
    """The lease at ``path`` (default ``$CONVOY_LEASE``); None when there is none to honour
    (not started by a convoy agent). A missing, unreadable or foreign file reads as revoked."""
    where = path if path is not None else os.environ.get(LEASE_ENV)
    if not where:
        return None
    for _ in range(_READ_TRIES):
        try:
            with open(where, "rb") as handle:
                data = handle.read(_BODY.size + _CHECK.size)
        except FileNotFoundError:
            return Lease(0, 0.0)  # the agent removed it: its job or round is over
        if len(data) != _BODY.size + _CHECK.size:
            return Lease(0, 0.0)
        body, (check,) = data[: _BODY.size], _CHECK.unpack(data[_BODY.size:])
        if zlib.crc32(body) != check:
            continue  # read while the agent rewrote it: read again
        magic, round_id, valid_until, expires_at = _BODY.unpack(body)
        return Lease(round_id, valid_until, expires_at) if magic == _MAGIC else Lease(0, 0.0)
    return Lease(0, 0.0)
