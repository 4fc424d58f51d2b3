"""The master's memory: job, nodes, rounds and events in one SQLite file in the run dir."""

from __future__ import annotations

import collections
import json
import math
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

from convoy.control.job import Event, Job
from convoy.control.nodes import NodeRecord
from convoy.control.rendezvous import Member, Membership, Rendezvous
from convoy.config import STATE_FILE, MasterConfig
from convoy.errors import ConfigError, StateWriteError


_SCHEMA = """
CREATE TABLE IF NOT EXISTS job (
    job_id TEXT PRIMARY KEY, status TEXT, restart_count INTEGER, max_restarts INTEGER,
    round_id INTEGER, min_nodes INTEGER, max_nodes INTEGER, master_url TEXT,
    outcome TEXT, created_at REAL, ended_at REAL, regroup_count INTEGER, done_nodes TEXT, config TEXT,
    excluded_nodes TEXT, port_retries INTEGER);
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, host TEXT, nproc INTEGER, state TEXT,
    node_rank INTEGER, first_seen REAL, last_seen REAL, instance TEXT);
CREATE TABLE IF NOT EXISTS rounds (
    round_id INTEGER PRIMARY KEY, closed_at REAL, world_size INTEGER,
    master_addr TEXT, master_port INTEGER, members TEXT);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL, kind TEXT, node_id TEXT,
    round_id INTEGER, message TEXT);
CREATE TABLE IF NOT EXISTS parts (name TEXT PRIMARY KEY, state TEXT);
"""


EVENTS_FILE = "events.jsonl"
NEW_COLUMNS = {"job": (("excluded_nodes", "TEXT"), ("port_retries", "INTEGER")), "nodes": (("instance", "TEXT"),)}
"""Columns newer than the first state files, by table, added to those when they are opened."""
MAX_PENDING_EVENTS = 10_000
"""Events kept in memory while the state cannot be written; beyond that the oldest are dropped (counted)."""
PARTS_SHARE = 0.1
"""Saves of ``lazy_parts`` changes make and write the parts (the roles' state is O(processes)) at most this share
of the time: at 1024 role processes each start's save made the whole roles state, 3/4 of the master's time."""
PARTS_REFRESH_S = 300.0
"""A save of the nodes' rows alone (``rows_only``) makes the parts only where they were last made this long ago: a
change the master made without applying it (an addresses' version published to a heartbeat; every other change is
applied, and its save makes the parts) reaches the state file within it. Making them holds the master's lock for
100-200 ms at 4096 role processes: at 30 s, one in three 10-second windows had a heartbeat p99 of 300-440 ms."""


class Store:
    """Write-through state; one connection guarded by a lock (the HTTP server is threaded).

    A write that fails (a full disk) keeps its events in memory, in order; the next save that
    succeeds writes them first, with one ``state_written`` event that says what was kept and lost.
    """

    def __init__(self, run_dir: Path, config_json: str = "") -> None:
        self.path = Path(run_dir) / STATE_FILE
        self.config_json = config_json
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[float, Event]] = collections.deque()
        self._pending_rounds: dict[int, tuple[Membership, float]] = {}
        """Rounds that closed while writes failed (a later one may have replaced them in the job by then)."""
        self._round_written = 0
        """The last round whose row was written (each is written once: at thousands of members, its list is not
        made again on every save)."""
        self.lost_events = 0
        """Events dropped from ``_pending`` because it was full, since the last good write."""
        self.failing_since: float | None = None
        """When (monotonic) the writes started to fail; None while they work."""
        self.fault = ""
        """Why the last write failed ('' while writes work)."""
        self.parts: dict[str, Callable[[], str]] = {}
        """More of the job's state, by name (the shard queues): each save writes the part's text if it changed."""
        self._written_parts: dict[str, str] = {}
        self.parts_owed = False
        """A save left the parts for later (``lazy_parts``): a later save writes them (the master's tick, soon)."""
        self._parts_at, self._parts_cost = -math.inf, 0.0
        """When the parts were last made and written, and what that took (monotonic seconds)."""
        self._unwritten_lines = 0
        try:
            private_file(self.path)  # SQLite gives its WAL and journal files the database's mode
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            self._add_new_columns()
        except (sqlite3.Error, OSError) as exc:
            raise ConfigError(f"cannot create the job's state file {str(self.path)!r}: {exc}; free space in the "
                              "run dir or give another --run-dir") from exc

    def _add_new_columns(self) -> None:
        """A state file written by an earlier version lacks the newer columns: add them."""
        for table, columns in NEW_COLUMNS.items():
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for column, kind in columns:
                if column not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    @property
    def pending(self) -> int:
        """Events waiting to be written."""
        return len(self._pending)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def save(self, job: Job, events: list[Event], master_url: str, nodes: list[NodeRecord],
             lazy_parts: bool = False, rows_only: bool = False) -> str | None:
        """Record events (after any kept from failed writes) and the job, round and node rows in one
        transaction, with the state of the master's other ``parts`` that changed. Returns a note when state
        that could not be written before now is; raises StateWriteError (the events are kept) when the
        write fails.

        ``lazy_parts``: the change is one a restarted master recovers without the parts (a process's start,
        which its agent reports again): they are left for a later save where they were written less than
        ``parts_due`` ago, so that a burst of such changes writes them (O(processes) each) a few times, not once
        per change.

        ``rows_only``: no change was applied, the save refreshes the nodes' rows (their last-seen times): the parts
        are made only where ``PARTS_REFRESH_S`` has passed since they were (at 4096 role processes making them held
        the master for 300-600 ms, every ``ROWS_REFRESH_S``), and what a lazy save left owed stays owed."""
        now = time.time()
        with self._lock:
            for event in events:
                if len(self._pending) >= MAX_PENDING_EVENTS:
                    self._pending.popleft()
                    self.lost_events += 1
                self._pending.append((now, event))
            if job.membership is not None and job.membership.round_id != self._round_written:
                self._pending_rounds.setdefault(job.membership.round_id, (job.membership, now))
            try:
                if rows_only:
                    self._write(job, master_url, nodes, now, time.monotonic() - self._parts_at < PARTS_REFRESH_S,
                                owed=self.parts_owed)
                else:
                    skip = lazy_parts and not self.parts_due()
                    self._write(job, master_url, nodes, now, skip, owed=skip)
            except (sqlite3.Error, OSError) as exc:
                self._roll_back()
                if self.failing_since is None:
                    self.failing_since = time.monotonic()
                self.fault = str(exc)
                raise StateWriteError(f"the job's state in {self.path} cannot be written: {exc}") from exc
            note = self._recovery_note() if self.failing_since is not None else None
            self._pending.clear()
            self._round_written = max(self._pending_rounds, default=self._round_written)
            self._pending_rounds.clear()
            self.failing_since, self.fault, self.lost_events = None, "", 0
            return note

    def _roll_back(self) -> None:
        try:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # SQLite already rolled back what a full disk interrupted

    def _recovery_note(self) -> str:
        assert self.failing_since is not None
        lost = f", {self.lost_events} older ones were lost" if self.lost_events else ""
        return (f"the job's state is written again after {time.monotonic() - self.failing_since:.0f} s; "
                f"{len(self._pending)} events kept in memory meanwhile are recorded{lost}")

    def parts_due(self) -> bool:
        """Whether the parts may be made and written now: at most ``PARTS_SHARE`` of the time goes to them."""
        return time.monotonic() - self._parts_at >= self._parts_cost / PARTS_SHARE

    def _write(self, job: Job, master_url: str, nodes: list[NodeRecord], now: float, skip_parts: bool = False,
               owed: bool = False) -> None:
        """One transaction; ``skip_parts``: without making the parts (``owed``: they are still to be written)."""
        to_wall = now - time.monotonic()  # node times are monotonic; the table keeps wall-clock times
        membership = job.membership
        rdzv = job.rendezvous
        rows = [(ts, e.kind, e.node_id, e.round_id, e.message) for ts, e in self._pending]
        if self.failing_since is not None:
            rows.append((now, "state_written", None, job.round_id, self._recovery_note()))
        self._db.execute("BEGIN")
        self._db.execute(
            "INSERT INTO job VALUES (?,?,?,?,?,?,?,?,?,COALESCE((SELECT created_at FROM job WHERE job_id=?),?),"
            "?,?,?,?,?,?) ON CONFLICT(job_id) DO UPDATE SET status=excluded.status,"
            " restart_count=excluded.restart_count, round_id=excluded.round_id, master_url=excluded.master_url,"
            " outcome=excluded.outcome, ended_at=excluded.ended_at, regroup_count=excluded.regroup_count,"
            " done_nodes=excluded.done_nodes, config=excluded.config, excluded_nodes=excluded.excluded_nodes,"
            " port_retries=excluded.port_retries",
            (job.job_id, job.status, job.restart_count, job.max_restarts, job.round_id, rdzv.min_nodes,
             rdzv.max_nodes, master_url, job.outcome, job.job_id, now, now if job.status != "running" else None,
             job.regroup_count, json.dumps(sorted(job.done_nodes)), self.config_json, json.dumps(job.excluded),
             job.port_retries),
        )
        for node in nodes:
            self._db.execute(
                "INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,?,?,?,?)",
                (node.node_id, node.host, node.nproc, node.state, _rank_of(membership, node.node_id),
                 node.first_seen + to_wall, node.last_seen + to_wall, node.instance),
            )
        for closed, closed_at in self._pending_rounds.values():
            self._save_round(closed, closed_at)
        self._db.executemany("INSERT INTO events (ts, kind, node_id, round_id, message) VALUES (?,?,?,?,?)", rows)
        began = time.monotonic()
        parts = {} if skip_parts else {name: text() for name, text in self.parts.items()}
        changed = [(name, text) for name, text in parts.items() if self._written_parts.get(name) != text]
        self._db.executemany("INSERT OR REPLACE INTO parts VALUES (?,?)", changed)
        cost = time.monotonic() - began
        self._db.execute("COMMIT")
        self._written_parts.update(changed)
        self.parts_owed = owed and skip_parts
        if not skip_parts:
            self._parts_at, self._parts_cost = began, cost
        self._append_events(rows)

    def _append_events(self, rows: list[tuple[Any, ...]]) -> None:
        """The events just recorded, also as JSON lines in ``RUN_DIR/events.jsonl`` (for log shippers and ``jq``);
        a line that cannot be written (a full disk) is counted in the next one's ``unwritten_before``."""
        if not rows:
            return
        lines = "".join(json.dumps({"ts": ts, "kind": kind, "node_id": node_id, "round_id": round_id,
                                    "message": message, **({"unwritten_before": self._unwritten_lines}
                                                           if self._unwritten_lines else {})}) + "\n"
                        for ts, kind, node_id, round_id, message in rows)
        try:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
            fd = os.open(self.path.with_name(EVENTS_FILE), flags, 0o600)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
            self._unwritten_lines = 0
        except OSError:
            self._unwritten_lines += len(rows)

    def _save_round(self, membership: Membership, now: float) -> None:
        members = json.dumps([[m.node_rank, m.node_id, m.host, m.nproc] for m in membership.members])
        self._db.execute(
            "INSERT OR IGNORE INTO rounds VALUES (?,?,?,?,?,?)",
            (membership.round_id, now, membership.world_size, membership.master_addr, membership.master_port, members),
        )


def restore(run_dir: Path, now: float) -> tuple[MasterConfig, Job, list[NodeRecord]]:
    """Rebuild a crashed master's config, job, and node registry from its state file.

    A closed round comes back with its membership; an open one comes back empty, and the
    agents waiting in it are told to join again. Nodes get a fresh heartbeat window and keep the agent process
    that last joined (a join it repeats, its reply lost with the old master, is not taken for a restarted agent).
    """
    state = read_status(run_dir, recent=0)
    row = state["job"]
    if row is None or not row["config"]:
        raise ConfigError(f"{str(run_dir)!r} holds no job that can be resumed")
    config = MasterConfig.from_json(row["config"])
    config.run_dir, config.job_id = Path(run_dir), row["job_id"]
    config.port = int(row["master_url"].rsplit(":", 1)[1])  # agents know this address: serve it again
    rdzv_config = config.rendezvous
    rendezvous = Rendezvous(rdzv_config.min_nodes, rdzv_config.max_nodes, rdzv_config.wait_s, now,
                            round_id=row["round_id"])
    last = state["round"]
    job = Job(row["job_id"], rendezvous, row["max_restarts"], rdzv_config.join_timeout_s, status=row["status"],
              restart_count=row["restart_count"], outcome=row["outcome"], regroup_count=row["regroup_count"] or 0,
              done_nodes=set(json.loads(row["done_nodes"] or "[]")),
              excluded=json.loads(row.get("excluded_nodes") or "{}"), port_retries=row.get("port_retries") or 0)
    if last is not None:
        members, offset = [], 0
        for node_rank, node_id, host, nproc in json.loads(last["members"]):
            members.append(Member(node_rank, node_id, host, nproc, offset))
            offset += nproc
        membership = Membership(last["round_id"], tuple(members), last["master_addr"], last["master_port"])
        if last["round_id"] == row["round_id"]:
            rendezvous.membership, job.announced_round = membership, row["round_id"]
        rendezvous.set_previous(membership)
    nodes = [NodeRecord(n["node_id"], n["host"], n["nproc"], now, now, n["state"], n.get("instance") or "")
             for n in state["nodes"]]
    return config, job, nodes


def read_status(run_dir: Path, recent: int = 15) -> dict[str, Any]:
    """Read a job's state from its run dir (works while it runs and after it ended)."""
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise ConfigError(f"no convoy job state in {str(run_dir)!r} (expected {STATE_FILE}); check --run-dir")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        job = db.execute("SELECT * FROM job").fetchone()
        nodes = db.execute("SELECT * FROM nodes ORDER BY node_rank IS NULL, node_rank, node_id").fetchall()
        last_round = db.execute("SELECT * FROM rounds ORDER BY round_id DESC LIMIT 1").fetchone()
        events = db.execute("SELECT * FROM events ORDER BY id DESC LIMIT ?", (recent,)).fetchall() if recent else []
        interval = db.execute("SELECT * FROM events WHERE kind = 'snapshot_interval' ORDER BY id DESC LIMIT 1"
                              ).fetchone()
    finally:
        db.close()
    return {
        "job": dict(job) if job else None,
        "nodes": [dict(n) for n in nodes],
        "round": dict(last_round) if last_round else None,
        "events": [dict(e) for e in reversed(events)],
        "snapshot_interval": dict(interval) if interval else None,
    }


def read_part(run_dir: Path, name: str) -> str | None:
    """The text ``Store.parts[name]`` last wrote to the run dir's state file (None if none)."""
    db = sqlite3.connect(f"file:{Path(run_dir) / STATE_FILE}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT state FROM parts WHERE name=?", (name,)).fetchone()
    except sqlite3.OperationalError:  # a state file older than the table
        return None
    finally:
        db.close()
    return None if row is None else str(row[0])


def private_file(path: Path) -> None:
    """Create ``path`` readable by its owner only (or make it so), never through a symlink."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _rank_of(membership: Membership | None, node_id: str) -> int | None:
    """The node's rank in the round (a lookup in the round's own index: a save writes a few nodes' rows, and
    building a table of all N members for each would make a burst of N saves cost N²)."""
    member = membership.member(node_id) if membership is not None else None
    return member.node_rank if member is not None else None
