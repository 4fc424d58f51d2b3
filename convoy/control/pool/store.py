"""Where the jobs of one machine keep their claims: one SQLite file (``CONVOY_POOL``, else
``/tmp/convoy-pool-<uid>/pool.db`` in a directory only this user may enter), written by each job's master and by
``convoy preempt``, read by all of them and by ``convoy pool``. A claim whose process is gone is dropped as it is
read, so a job that was SIGKILLed holds nothing. The pool's capacity is ``CONVOY_POOL_CPUS`` where set, else the
CPUs this process may run on (its affinity, and its cgroup's quota where one is set)."""

from __future__ import annotations

import math
import os
import sqlite3
import time
from pathlib import Path

from convoy.control.pool.claims import Claim, PoolView, room_for
from convoy.errors import ConfigError

POOL_ENV = "CONVOY_POOL"
POOL_CPUS_ENV = "CONVOY_POOL_CPUS"
BUSY_TIMEOUT_S = 0.5
"""A call waits this long for another's transaction (the master calls under its lock: never long)."""
SCHEMA = ("CREATE TABLE IF NOT EXISTS claims (job_id TEXT PRIMARY KEY, priority INTEGER NOT NULL, held REAL NOT NULL, "
          "floor REAL NOT NULL, wants REAL NOT NULL, since REAL NOT NULL, pid INTEGER NOT NULL, run_dir TEXT NOT NULL)")


def pool_path() -> Path:
    """The pool's file: ``CONVOY_POOL``, else one per user under /tmp (its directory made 0700)."""
    given = os.environ.get(POOL_ENV)
    if given:
        return Path(given)
    return Path(f"/tmp/convoy-pool-{os.getuid()}") / "pool.db"


def machine_cpus() -> float:
    """The pool's CPUs: ``CONVOY_POOL_CPUS`` where set (the jobs are to share part of the machine), else the CPUs this
    process may run on: its affinity, lowered to its cgroup v2 quota where one is set."""
    given = os.environ.get(POOL_CPUS_ENV)
    if given is not None:
        try:
            cpus = float(given)
        except ValueError:
            cpus = -1.0
        if not (math.isfinite(cpus) and cpus > 0):
            raise ConfigError(f"{POOL_CPUS_ENV}={given!r}: give the pool's CPUs as a positive number, e.g. 8")
        return cpus
    cpus = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cpus


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PoolStore:
    """One connection to the pool's file; each call is one short transaction."""

    def __init__(self, path: Path | None = None, capacity: float | None = None) -> None:
        self.path = path or pool_path()
        self.capacity = machine_cpus() if capacity is None else capacity
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                       check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"the CPU pool at {self.path} cannot be opened ({exc}); give {POOL_ENV} a writable "
                              "path") from exc

    def put(self, claim: Claim) -> None:
        """Make or replace this claim."""
        if not all(math.isfinite(x) and x >= 0 for x in (claim.held, claim.floor, claim.wants)):
            raise ConfigError(f"claim of {claim.job_id}: CPUs must be finite and >= 0")
        self._db.execute("INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (claim.job_id, claim.priority, claim.held, claim.floor, claim.wants,
                          claim.since or time.time(), claim.pid or os.getpid(), claim.run_dir))

    def take(self, claim: Claim, cpus: float) -> bool:
        """Add ``cpus`` to this job's held CPUs (and take them off what it asks for) if the pool has room for them
        (``room_for``), in one transaction that no other job's can interleave with; the claim is made where it has
        none yet."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            view = self.view()
            mine = view.claim(claim.job_id) or claim
            if room_for(view, claim.job_id, claim.priority) + 1e-9 < cpus:
                self._db.execute("ROLLBACK")
                return False
            self._db.execute("INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (claim.job_id, claim.priority, mine.held + cpus, mine.floor, max(0.0, mine.wants - cpus),
                              mine.since or time.time(), claim.pid or os.getpid(), claim.run_dir))
            self._db.execute("COMMIT")
            return True
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def remove(self, job_id: str) -> None:
        self._db.execute("DELETE FROM claims WHERE job_id = ?", (job_id,))

    def view(self) -> PoolView:
        """Every live claim; those of processes that are gone are deleted."""
        rows = self._db.execute("SELECT job_id, priority, held, floor, wants, since, pid, run_dir FROM claims")
        claims = [Claim(*row) for row in rows.fetchall()]
        for claim in claims:
            if not _alive(claim.pid):
                self.remove(claim.job_id)
        return PoolView(self.capacity, tuple(claim for claim in claims if _alive(claim.pid)))

    def sync(self, claim: Claim) -> PoolView:
        """Write this claim, then read the pool."""
        self.put(claim)
        return self.view()

    def close(self) -> None:
        self._db.close()
