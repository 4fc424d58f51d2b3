"""What each dashboard page shows, as JSON read from a job's state file (read-only: the master's file, while it runs
or after it ended). One function per page; each opens its own read-only connection."""

from __future__ import annotations

import json
import math
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator

from convoy.config import STATE_FILE
from convoy.control.roles.views import read_role_views
from convoy.control.store import read_part, read_status
from convoy.control.training.master import PROPOSALS_PART, STATE_PART
from convoy.errors import ConfigError

END_KINDS = ("restart", "regroup", "reconfigure", "port_retry", "worker_failed", "node_left", "node_excluded")
"""Events that say why a round ended (the first one after its start)."""
MAX_EVENTS = 2000
POINTS_PER_TASK = 1500
"""At most this many points per rank go to a page at load (evenly spread over the run, the newest kept)."""
LOG_TAIL_BYTES = 4096
LOG_TAIL_LINES = 12
METRIC_FIELDS = ("loss", "step_time_s", "samples_per_s")


class ReadOnly:
    """A read-only connection to a run dir's state file, closed on exit; or ``kept``, one the caller keeps open
    (the live stream's, asked many times a second), left open."""

    def __init__(self, run_dir: Path, kept: sqlite3.Connection | None = None) -> None:
        self.kept = kept is not None
        self.db = kept if kept is not None else connect(run_dir)

    def __enter__(self) -> sqlite3.Connection:
        return self.db

    def __exit__(self, *_: object) -> None:
        if not self.kept:
            self.db.close()


def connect(run_dir: Path) -> sqlite3.Connection:
    db = sqlite3.connect(f"file:{Path(run_dir) / STATE_FILE}?mode=ro", uri=True, timeout=2.0,
                         check_same_thread=False)
    db.row_factory = sqlite3.Row
    return db


def not_a_job(run_dir: Path) -> str:
    """'' when ``run_dir`` holds a job's state, else why not (shown on the index, a 404 for its pages)."""
    if not Path(run_dir).is_dir():
        return f"{str(run_dir)!r} is not a directory"
    if not (Path(run_dir) / STATE_FILE).is_file():
        return f"{str(run_dir)!r} holds no convoy job (no {STATE_FILE})"
    try:
        if read_status(run_dir, recent=0)["job"] is None:
            return f"{str(run_dir)!r}: its {STATE_FILE} has no job row yet"
    except sqlite3.Error as exc:
        return f"{str(run_dir)!r}: its {STATE_FILE} cannot be read ({exc})"
    return ""


def overview(run_dir: Path) -> dict[str, Any]:
    state = read_status(run_dir, recent=0)
    job = state["job"] or {}
    last = state["round"]
    ended = job.get("ended_at")
    created = job.get("created_at") or time.time()
    config = json.loads(job["config"]) if job.get("config") else {}
    members = json.loads(last["members"]) if last else []
    return {
        "job_id": job.get("job_id"), "status": job.get("status"), "round_id": job.get("round_id"),
        "restart_count": job.get("restart_count"), "max_restarts": job.get("max_restarts"),
        "regroup_count": job.get("regroup_count") or 0, "outcome": job.get("outcome") or "",
        "created_at": created, "ended_at": ended, "run_time_s": (ended or time.time()) - created,
        "master_url": job.get("master_url"), "min_nodes": job.get("min_nodes"), "max_nodes": job.get("max_nodes"),
        "nodes": len(members), "world_size": last["world_size"] if last else 0,
        "nodes_alive": sum(n["state"] == "alive" for n in state["nodes"]),
        "roles": _roles(run_dir), "auto_apply": config.get("auto_apply", []),
    }


def _roles(run_dir: Path) -> list[dict[str, Any]]:
    """Each role's counts (a job of roles), else the one role of a plain job."""
    try:
        return read_role_views(run_dir) or [{"name": "worker", "count": "one per slot"}]
    except ConfigError as exc:
        return [{"name": "?", "count": str(exc)}]


NODES_PAGE = 200
"""Nodes per page: a job of thousands of nodes is shown a page at a time (each node's ranks bring their log tails)."""


def nodes(run_dir: Path, last_seen: dict[str, float] | None = None, offset: int = 0,
          limit: int = NODES_PAGE) -> dict[str, Any]:
    """A page of the nodes (``limit`` from ``offset``; ``total`` says how many there are) with their ranks (of the
    last round), each rank's newest status (memory) and log tail. ``last_seen``: a live master's heartbeat times
    (wall clock), fresher than the state file's."""
    state = read_status(run_dir, recent=0)
    last = state["round"]
    ranks: dict[str, list[int]] = {}
    start = 0
    for _node_rank, node_id, _host, nproc in sorted(json.loads(last["members"]) if last else []):
        ranks[node_id] = list(range(start, start + nproc))
        start += nproc
    latest = {row["rank"]: row for row in _latest(run_dir)}
    round_id = last["round_id"] if last else 0
    out = []
    for node in state["nodes"][offset:offset + limit]:
        workers = [{"rank": rank, "memory_bytes": (latest.get(rank) or {}).get("memory_bytes"),
                    "step": (latest.get(rank) or {}).get("step"), "log_tail": _tail(run_dir, round_id, rank)}
                   for rank in ranks.get(node["node_id"], [])]
        seen = (last_seen or {}).get(node["node_id"], node["last_seen"])
        out.append({"node_id": node["node_id"], "host": node["host"], "nproc": node["nproc"], "state": node["state"],
                    "node_rank": node["node_rank"], "last_heartbeat": seen, "workers": workers})
    return {"round_id": round_id, "nodes": out, "now": time.time(), "total": len(state["nodes"]), "offset": offset,
            "limit": limit}


def _latest(run_dir: Path) -> list[dict[str, Any]]:
    with ReadOnly(run_dir) as db:
        try:
            rows = db.execute("SELECT s.rank, s.step, s.memory_bytes FROM train_status s JOIN (SELECT task, MAX(id) "
                              "AS id FROM train_status GROUP BY task) n ON s.id = n.id").fetchall()
        except sqlite3.OperationalError:
            return []
    return [dict(row) for row in rows]


def _tail(run_dir: Path, round_id: int, rank: int) -> list[str]:
    path = Path(run_dir) / "logs" / f"round{round_id}" / f"rank{rank}.log"
    try:
        with open(path, "rb") as log:
            log.seek(0, 2)
            size = log.tell()
            log.seek(max(0, size - LOG_TAIL_BYTES))
            text = log.read().decode("utf-8", "replace")
    except OSError:
        return []
    return text.splitlines()[-LOG_TAIL_LINES:]


def events(run_dir: Path, after: int = 0, kind: str = "", text: str = "", limit: int = 500,
           kept: sqlite3.Connection | None = None) -> dict[str, Any]:
    """The newest ``limit`` events after id ``after`` (oldest first), of one kind and/or containing a text."""
    where, args = ["id > ?"], [after]
    if kind:
        where.append("kind = ?")
        args.append(kind)  # type: ignore[arg-type]
    if text:
        where.append("instr(lower(message), lower(?)) > 0")
        args.append(text)  # type: ignore[arg-type]
    with ReadOnly(run_dir, kept) as db:
        rows = db.execute(f"SELECT * FROM (SELECT * FROM events WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ?)"
                          " ORDER BY id", (*args, min(limit, MAX_EVENTS))).fetchall()
        kinds = [row[0] for row in db.execute("SELECT DISTINCT kind FROM events ORDER BY kind")]
        total = db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    return {"events": [dict(row) for row in rows], "kinds": kinds, "total": total}


def metrics(run_dir: Path, after: int = 0, upto: int | None = None, per_task: int = POINTS_PER_TASK,
            kept: sqlite3.Connection | None = None) -> dict[str, Any]:
    """Each rank's points (step, loss, step time, throughput) after row id ``after``, columnar, in step order and
    thinned to about ``per_task`` points: a rank whose steps span more keeps every k-th step (k = span / per_task;
    a step run twice, after a restart, keeps both) and its newest point. SQLite does the thinning on the (task,
    step) index, so a job of 100,000 points costs the reader a few thousand rows, not all of them."""
    bound = "" if upto is None else " AND id <= ?"
    args = (after,) if upto is None else (after, upto)
    columns = f"id, task, step, ts, {', '.join(METRIC_FIELDS)}"
    series: dict[str, dict[str, list[Any]]] = {}
    with ReadOnly(run_dir, kept) as db:
        try:
            plain = db.cursor()
            plain.row_factory = None  # tuples: a few thousand rows are read, Row objects would cost more
            spans = plain.execute(f"SELECT task, MIN(step), MAX(step), COUNT(*), MAX(id) FROM train_status INDEXED BY "
                                  f"train_status_task WHERE id > ?{bound} GROUP BY task ORDER BY task", args).fetchall()
            for task, first, last, count, newest in spans:
                every = 1 if count <= per_task else -(-(last - first + 1) // per_task)
                rows = plain.execute(f"SELECT {columns} FROM train_status WHERE task = ? AND id > ?{bound} AND "
                                  "((step - ?) % ? = 0 OR id = ?) ORDER BY step, id",
                                  (task, *args, first, every, newest))
                column = series[task] = {"step": [], "ts": [], **{name: [] for name in METRIC_FIELDS}}
                for row in rows:
                    column["step"].append(row[2])
                    column["ts"].append(row[3])
                    for offset, name in enumerate(METRIC_FIELDS):
                        column[name].append(_number(row[4 + offset]))
        except sqlite3.OperationalError:
            return {"series": {}, "last_id": after}
    return {"series": series, "last_id": max((span[4] for span in spans), default=after)}


def _number(value: Any) -> float | None:
    """A loss kept as text ('nan', 'inf') is drawn as a gap."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def config(run_dir: Path) -> dict[str, Any]:
    saved = read_part(run_dir, STATE_PART)
    proposals = read_part(run_dir, PROPOSALS_PART)
    state = json.loads(saved) if saved else {}
    return {"versions": state.get("versions", []), "overrides": state.get("overrides", {}),
            "schema": state.get("schema"), "proposals": json.loads(proposals) if proposals else []}


def rounds(run_dir: Path) -> dict[str, Any]:
    """Every round: when it started (closed its membership), who was in it, and why it ended."""
    job = read_status(run_dir, recent=0)["job"] or {}
    with ReadOnly(run_dir) as db:
        rows = [dict(r) for r in db.execute("SELECT round_id, closed_at, world_size, members FROM rounds ORDER BY "
                                            "round_id")]
        marks = db.execute(f"SELECT id, ts, kind, round_id, message FROM events WHERE kind IN "
                           f"({', '.join('?' * (len(END_KINDS) + 1))}) ORDER BY id",
                           ("round_closed", *END_KINDS)).fetchall()
    ends = dict(_why_ended(marks))
    out = []
    for index, row in enumerate(rows):
        following = rows[index + 1]["closed_at"] if index + 1 < len(rows) else job.get("ended_at")
        why = ends.get(row["round_id"]) or (job.get("outcome") or job.get("status") if following else "")
        out.append({"round_id": row["round_id"], "started_at": row["closed_at"], "ended_at": following,
                    "world_size": row["world_size"], "nodes": [m[1] for m in json.loads(row["members"])],
                    "why_ended": why})
    return {"rounds": out, "now": time.time(), "status": job.get("status")}


def _why_ended(marks: list[sqlite3.Row]) -> Iterator[tuple[int, str]]:
    """After a round's ``round_closed`` event, the first ending event names why it ended."""
    current: int | None = None
    for mark in marks:
        if mark["kind"] == "round_closed":
            current = mark["round_id"]
        elif current is not None:
            yield current, f"{mark['kind']}: {mark['message']}"
            current = None


def probe(db: sqlite3.Connection) -> tuple[Any, ...]:
    """What changed since the last look, cheaply: the newest event and status row, the job's status and round."""
    events_max = db.execute("SELECT MAX(id) FROM events").fetchone()[0] or 0
    try:
        points_max = db.execute("SELECT MAX(id) FROM train_status").fetchone()[0] or 0
    except sqlite3.OperationalError:
        points_max = 0
    job = db.execute("SELECT status, round_id FROM job").fetchone()
    return events_max, points_max, tuple(job) if job else ("", 0)
