"""Where the jobs of one machine keep their claims of CPUs and memory: one SQLite file (``CONVOY_POOL``, else
``/tmp/convoy-pool-<uid>/pool.db`` in a directory only this user may enter), written by each job's master and by
``convoy preempt``, read by all of them and by ``convoy pool``. A claim whose process is gone is dropped as it is
read, so a job that was SIGKILLed holds nothing. The pool's capacity is ``CONVOY_POOL_CPUS`` and
``CONVOY_POOL_MEMORY`` where set, else the CPUs this process may run on (its affinity, and its cgroup's quota where
one is set) and the machine's memory (its cgroup's limit where one is set)."""

from __future__ import annotations

import math
import os
import sqlite3
import time
from pathlib import Path

from convoy.control.pool.claims import Amount, Claim, PoolView, room_for
from convoy.errors import ConfigError
from convoy.roles_config import parse_memory

POOL_ENV = "CONVOY_POOL"
POOL_CPUS_ENV = "CONVOY_POOL_CPUS"
POOL_MEMORY_ENV = "CONVOY_POOL_MEMORY"
BUSY_TIMEOUT_S = 0.5
"""A call waits this long for another's transaction (the master calls under its lock: never long)."""
SCHEMA = ("CREATE TABLE IF NOT EXISTS claims_v2 (job_id TEXT PRIMARY KEY, priority INTEGER NOT NULL, "
          "held_cpus REAL NOT NULL, held_memory REAL NOT NULL, floor_cpus REAL NOT NULL, floor_memory REAL NOT NULL, "
          "wants_cpus REAL NOT NULL, wants_memory REAL NOT NULL, since REAL NOT NULL, pid INTEGER NOT NULL, "
          "run_dir TEXT NOT NULL)")
COLUMNS = ("job_id, priority, held_cpus, held_memory, floor_cpus, floor_memory, wants_cpus, wants_memory, since, pid, "
           "run_dir")


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


def machine_memory() -> float:
    """The pool's memory in bytes: ``CONVOY_POOL_MEMORY`` where set (e.g. ``64GiB``), else this machine's, lowered to
    its cgroup v2 limit where one is set."""
    given = os.environ.get(POOL_MEMORY_ENV)
    if given is not None:
        try:
            size, auto = parse_memory(given)
        except ConfigError as exc:
            raise ConfigError(f"{POOL_MEMORY_ENV}: {exc}") from None
        if auto or size is None:
            raise ConfigError(f"{POOL_MEMORY_ENV}={given!r}: give a size, e.g. 64GiB")
        return float(size)
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            memory = min(memory, float(limit))
    except (OSError, ValueError):
        pass
    return memory


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

    def __init__(self, path: Path | None = None, capacity: Amount | None = None) -> None:
        self.path = path or pool_path()
        self.capacity = Amount(machine_cpus(), machine_memory()) if capacity is None else capacity
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
        amounts = (claim.held, claim.floor, claim.wants)
        if not all(math.isfinite(x) and x >= 0 for amount in amounts for x in (amount.cpus, amount.memory)):
            raise ConfigError(f"claim of {claim.job_id}: CPUs and memory must be finite and >= 0")
        self._db.execute(f"INSERT OR REPLACE INTO claims_v2 ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (claim.job_id, claim.priority, *_pair(claim.held), *_pair(claim.floor), *_pair(claim.wants),
                          claim.since or time.time(), claim.pid or os.getpid(), claim.run_dir))

    def take(self, claim: Claim, amount: Amount) -> bool:
        """Add ``amount`` to this job's held CPUs and memory (and take it off what it asks for) if the pool has room
        for it (``room_for``), in one transaction that no other job's can interleave with; the claim is made where it
        has none yet."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            view = self.view()
            mine = view.claim(claim.job_id) or claim
            if not amount.within(room_for(view, claim.job_id, claim.priority)):
                self._db.execute("ROLLBACK")
                return False
            self.put(Claim(claim.job_id, claim.priority, mine.held + amount, mine.floor,
                           (mine.wants - amount).clipped(), mine.since or time.time(), claim.pid, claim.run_dir))
            self._db.execute("COMMIT")
            return True
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def remove(self, job_id: str) -> None:
        self._db.execute("DELETE FROM claims_v2 WHERE job_id = ?", (job_id,))

    def view(self) -> PoolView:
        """Every live claim; those of processes that are gone are deleted."""
        rows = self._db.execute(f"SELECT {COLUMNS} FROM claims_v2").fetchall()
        claims = [_claim(row) for row in rows]
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


def _pair(amount: Amount) -> tuple[float, float]:
    return amount.cpus, amount.memory


def _claim(row: tuple) -> Claim:  # type: ignore[type-arg]
    job_id, priority, held_cpus, held_memory, floor_cpus, floor_memory, wants_cpus, wants_memory, since, pid, run_dir \
        = row
    return Claim(job_id, priority, Amount(held_cpus, held_memory), Amount(floor_cpus, floor_memory),
                 Amount(wants_cpus, wants_memory), since, pid, run_dir)
