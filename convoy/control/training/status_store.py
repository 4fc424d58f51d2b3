"""The ranks' training status (``convoy.report``) as time series in the job's SQLite state file, bounded.

Each rank keeps at most ``MAX_POINTS_PER_TASK`` rows: when it has more, every other row of its older half is
deleted, so the newest steps stay at full resolution and the whole run stays, thinner the older it is. A write
that fails (a full disk) drops those points and counts them: training status never stops the job.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

from convoy.config import STATE_FILE

MAX_POINTS_PER_TASK = 4096
COLUMNS = ("task", "role", "rank", "step", "ts", "loss", "step_time_s", "samples_per_s", "memory_bytes",
           "grad_norm", "metrics")
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS train_status (id INTEGER PRIMARY KEY AUTOINCREMENT, {", ".join(COLUMNS)});
CREATE INDEX IF NOT EXISTS train_status_task ON train_status (task, step);
"""


class StatusStore:
    """Appends status rows from the master's threads; one connection of its own, guarded by a lock."""

    def __init__(self, run_dir: Path, max_per_task: int = MAX_POINTS_PER_TASK) -> None:
        self.path = Path(run_dir) / STATE_FILE
        self.max_per_task = max_per_task
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self.dropped = 0
        """Rows that could not be written (since the start)."""
        self.fault = ""
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=5.0)
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def add(self, rows: list[tuple[Any, ...]]) -> bool:
        """Write ``rows`` (in COLUMNS order); False (and the rows counted as dropped) when the write failed."""
        if not rows:
            return True
        with self._lock:
            try:
                self._db.execute("BEGIN")
                self._db.executemany(f"INSERT INTO train_status ({', '.join(COLUMNS)}) VALUES "
                                     f"({', '.join('?' * len(COLUMNS))})", rows)
                for task in {row[0] for row in rows}:
                    self._bound(task, sum(row[0] == task for row in rows))
                self._db.execute("COMMIT")
            except (sqlite3.Error, OSError) as exc:
                try:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                self._counts.clear()  # counted again on the next write
                self.dropped += len(rows)
                self.fault = str(exc)
                return False
            self.fault = ""
            return True

    def _bound(self, task: str, added: int) -> None:
        if task not in self._counts:
            self._counts[task] = self._db.execute("SELECT COUNT(*) FROM train_status WHERE task=?",
                                                  (task,)).fetchone()[0]
        else:
            self._counts[task] += added
        if self._counts[task] <= self.max_per_task:
            return
        ids = [row[0] for row in self._db.execute("SELECT id FROM train_status WHERE task=? ORDER BY step, id",
                                                  (task,))]
        older = ids[: len(ids) // 2]
        gone = older[1::2]
        self._db.executemany("DELETE FROM train_status WHERE id=?", [(i,) for i in gone])
        self._counts[task] -= len(gone)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def read_metrics(run_dir: Path, task: str = "", since_step: int = -1, limit: int = 1000) -> list[dict[str, Any]]:
    """Status rows (oldest first) of one task (``role:rank``; '' for all) after ``since_step``, at most ``limit``
    (the newest of them)."""
    path = Path(run_dir) / STATE_FILE
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        where, args = "step > ?", [since_step]
        if task:
            where, args = where + " AND task = ?", [*args, task]
        rows = db.execute(f"SELECT * FROM (SELECT * FROM train_status WHERE {where} ORDER BY step DESC, id DESC "
                          "LIMIT ?) ORDER BY step, id", (*args, limit)).fetchall()
    except sqlite3.OperationalError:  # no status table yet
        return []
    finally:
        db.close()
    return [_public(row) for row in rows]


def latest_by_task(run_dir: Path) -> list[dict[str, Any]]:
    """Each task's newest status row."""
    path = Path(run_dir) / STATE_FILE
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        rows = db.execute("SELECT s.* FROM train_status s JOIN (SELECT task, MAX(id) AS id FROM train_status GROUP BY "
                          "task) newest ON s.id = newest.id ORDER BY s.role, s.rank").fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        db.close()
    return [_public(row) for row in rows]


def _public(row: sqlite3.Row) -> dict[str, Any]:
    out = {key: row[key] for key in COLUMNS}  # a NaN or inf loss stays text ("nan"): the JSON stays strict
    out["metrics"] = json.loads(out["metrics"]) if out["metrics"] else {}
    return out
