"""A role service's fence against stale callers: a process whose rank was started again (a newer incarnation runs
now) may not use the service, on a new connection or on one it opened while it was current. The current
incarnations are the agent's addresses file (``convoy.worker.role_env``), read again when the file changed (one ``stat``
per message) and at least every ``REREAD_S`` (two replacements within one tick of the file clock could leave the
same inode, time and size)."""

from __future__ import annotations

import os
import threading
import time

from convoy.errors import ConfigError
from convoy.parallel.transport.errors import StaleIncarnation
from convoy.parallel.transport.handshake import Identity
from convoy.worker.role_env import RoleInfo

REREAD_S = 0.1


class IncarnationFence:
    """``check(caller)`` raises ``StaleIncarnation`` when the caller's rank runs as a newer incarnation; a caller
    of a role or rank the file does not list (or before the agent's first file) passes."""

    def __init__(self, info: RoleInfo) -> None:
        self.info = info
        self.path = info.addresses_file
        self._seen: tuple[int, int, int] | None = None
        self._read_at = 0.0
        self._lock = threading.Lock()

    def check(self, caller: Identity) -> None:
        self._refresh()
        current = self.info.current_incarnation(caller.role, caller.rank)
        if current is not None and caller.incarnation < current:
            raise StaleIncarnation(f"{caller.describe()} has ended: {caller.role} {caller.rank} runs as incarnation "
                                   f"{current} now; a process of an ended incarnation may not use this service "
                                   "(it should stop)")

    def _refresh(self) -> None:
        if not self.path:
            return
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return
        seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)  # the agent replaces the file whole: a new inode
        if seen == self._seen and time.monotonic() - self._read_at < REREAD_S:
            return
        with self._lock:
            try:
                self.info = self.info.refresh()
            except ConfigError:
                pass  # not the agent's file (it writes whole files): keep what was known
            self._seen, self._read_at = seen, time.monotonic()
