"""What a worker needs to go on after a parameter server was killed and restored: the pushes that server has not
reported kept (in its newest snapshot), to resend in order, and the wait for the server's next incarnation at the
address the job publishes for it (the same one, or a new one when it moved). Semantics: snapshots.py."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from convoy.errors import ConfigError
from convoy.parallel.transport import REQUEST_S, Connection, ConnectionLost, Credentials, Message, Refused, \
    StaleIncarnation, TransportError

SERVICE = "parameter server"
"""What a PS is called in its connections' errors."""
FOLLOW_S = 60.0
"""How long a worker waits for a lost server to answer again before it gives up."""
FOLLOW_POLL_S = 0.2
PROBE_S = 2.0
"""How long one look at a published address may take: whatever listens on a stale one (another process that
took the port) must not hold the wait up."""
Follow = Callable[[], Sequence[str]]
"""The servers' current addresses (``""`` for one that is down), e.g. ``convoy.role().refresh().peers("ps")``."""


class ServerLost(TransportError):
    """A parameter server went away and no new incarnation answered in time."""


class Unkept:
    """One server's pushes from this worker that its newest snapshot does not hold yet, numbered as the server
    counts them (this worker's n-th push applied there is number n). Thread-safe: the push thread trims it."""

    def __init__(self) -> None:
        self.entries: deque[tuple[int, Message]] = deque()
        self.lock = threading.Lock()

    def add(self, number: int, message: Message) -> None:
        with self.lock:
            self.entries.append((number, message))

    def trim(self, kept: int) -> None:
        """Drop the pushes the server has in its newest snapshot."""
        with self.lock:
            while self.entries and self.entries[0][0] <= kept:
                self.entries.popleft()

    def resume(self, applied: int, pushed: int) -> tuple[list[Message], int]:
        """For a server that came back with ``applied`` of this worker's ``pushed`` pushes: the pushes to resend, in
        order (renumbered after ``applied``), and how many are lost (older than every push held here)."""
        with self.lock:
            first = self.entries[0][0] if self.entries else pushed + 1
            lost = max(0, first - 1 - applied)
            resend = [message for number, message in self.entries if number > applied]
            self.entries = deque((applied + i + 1, message) for i, message in enumerate(resend))
            return resend, lost

    def __len__(self) -> int:
        return len(self.entries)


@dataclass
class Found:
    connection: Connection
    address: str
    applied: int
    """This worker's pushes the server holds now."""
    kept: int


def find_server(follow: Follow, server: int, worker: str, last: str, credentials: Credentials,
                timeout: float = FOLLOW_S) -> Found:
    """Wait until server ``server`` answers, holding a shard, at the address ``follow`` publishes for it; a
    ``ServerLost`` naming the last address and why after ``timeout``."""
    deadline = time.monotonic() + timeout
    why = "no address published yet"
    while True:
        try:
            listed = list(follow())
            address = listed[server] if server < len(listed) else ""
        except ConfigError as exc:
            address, why = "", str(exc)
        if address:
            found = _ask(address, worker, credentials)
            if isinstance(found, Found):
                return found
            why = found
        if time.monotonic() > deadline:
            raise ServerLost(f"parameter server {server} (last at {last}) went away and no incarnation of it answered "
                             f"within {timeout:.0f} s ({why}); see its log under RUN_DIR/logs/roles/ps{server}.log")
        time.sleep(FOLLOW_POLL_S)


def _ask(address: str, worker: str, credentials: Credentials) -> Found | str:
    """The server at ``address`` if it answers holding a shard, else why not (a refusal of this worker as stale
    is raised: it must stop, not wait)."""
    try:
        connection = Connection(address, PROBE_S, credentials, service=SERVICE)
    except StaleIncarnation:
        raise
    except (ConnectionLost, Refused) as exc:  # not up yet, or another job's service on a stale address
        return str(exc)
    try:
        status = connection.request(Message("status", {"worker": worker}))
    except (TransportError, ValueError, KeyError) as exc:  # gone again, or not a parameter server at all
        connection.close()
        return f"{address} did not answer as a parameter server: {exc}"
    if not status.meta.get("ready", True):
        connection.close()
        return f"the server at {address} holds no shard (was it restarted without CONVOY_ROLE_RESTORE=1?)"
    connection.settimeout(REQUEST_S)
    return Found(connection, address, int(status.meta["applied"]), int(status.meta.get("kept", 0)))
