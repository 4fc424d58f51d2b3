"""The jobs of benchmarks/live_config.py: ``convoy run`` of live_worker.py in its own session, its master's
config API (``PUT``/``GET /v1/config``), the ranks' step logs, and the checks made on them afterwards."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from convoy.control.store import read_status
from convoy.control.token import TOKEN_FILE

WORKER = Path(__file__).resolve().parent / "live_worker.py"
POLL_S = 0.01
T = TypeVar("T")


@dataclass
class Row:
    step: int
    lr: float
    batch: int
    loss: str
    """As the rank wrote it (repr), so that traces compare bit for bit."""
    round_id: int
    started: float


class Job:
    """``convoy run --nnodes N --nproc-per-node P`` of the worker; ``stop()`` ends its whole session."""

    def __init__(self, tmp: Path, nnodes: int, nproc: int, sets: list[str], worker_args: list[str]) -> None:
        tmp.mkdir(parents=True)
        self.run_dir, self.logs, self.console = tmp / "run", tmp / "logs", tmp / "console.log"
        self.logs.mkdir()
        self.nranks = nnodes * nproc
        argv = [sys.executable, "-m", "convoy", "run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
                "--run-dir", str(self.run_dir), "--stop-grace", "2"]
        for item in sets:
            argv += ["--set", item]
        argv += [str(WORKER), "--log-dir", str(self.logs), *worker_args]
        with open(self.console, "wb") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self._url = ""
        self.unset = 0
        """How many times ``ensure`` found a ``--set`` value missing from version 1."""
        self._token = ""
        self._rows: dict[int, list[Row]] = {}
        self._offsets: dict[int, int] = {}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        if not self._url:
            self._url = read_status(self.run_dir, recent=0)["job"]["master_url"]
            self._token = (self.run_dir / TOKEN_FILE).read_text().strip()
        request = urllib.request.Request(f"http://{self._url}/v1{path}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Authorization": f"Bearer {self._token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{method} /v1{path} {body}: {exc.code} {exc.read().decode()[:300]}") from None

    def put(self, values: dict[str, Any], at_step: int | None = None, reason: str = "") -> dict[str, Any]:
        body: dict[str, Any] = {"values": values, "reason": reason}
        if at_step is not None:
            body["at_step"] = at_step
        return self.api("PUT", "/config", body)

    def ensure(self, values: dict[str, Any]) -> None:
        """Make the newest version hold ``values`` (``--set`` gives them, or should: a PUT if it did not)."""
        newest = self.api("GET", "/config")["versions"][-1]["values"]
        missing = {k: v for k, v in values.items() if newest.get(k) != v}
        if missing:
            self.put(missing, reason="--set was not applied")
            self.unset += 1

    def wait_active(self, number: int, timeout_s: float = 60.0) -> None:
        """Until the master counts version ``number`` as run by every rank (a restart version must be, before
        the next change is accepted)."""
        def active() -> bool | None:
            versions = self.api("GET", "/config")["versions"]
            return True if any(v["number"] == number and v["status"] != "pending" for v in versions) else None
        self.wait(active, timeout_s, f"version {number} active", poll_s=0.1)

    def rows(self) -> dict[int, list[Row]]:
        """Every rank's log lines so far (read on from where the last call stopped)."""
        for path in sorted(self.logs.glob("rank*.log")):
            rank = int(path.stem.removeprefix("rank"))
            with open(path, "rb") as f:
                f.seek(self._offsets.get(rank, 0))
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]
            self._offsets[rank] = self._offsets.get(rank, 0) + len(complete)
            for line in complete.decode().splitlines():
                p = line.split()
                if len(p) == 6:
                    self._rows.setdefault(rank, []).append(Row(int(p[0]), float(p[1]), int(p[2]), p[3], int(p[4]),
                                                               float(p[5])))
        return self._rows

    def newest_step(self) -> int:
        rows = self.rows()
        if len(rows) < self.nranks or not all(rows.values()):
            return -1
        return min(r[-1].step for r in rows.values())

    def wait(self, probe: Callable[[], T | None], timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = probe()
            if value is not None:
                return value
            if not self.alive():
                value = probe()
                if value is not None:
                    return value
                raise RuntimeError(f"the job ended before {what}: {self.last_lines()}")
            time.sleep(poll_s)
        raise RuntimeError(f"no {what} within {timeout_s:.0f} s: {self.last_lines()}")

    def wait_step(self, step: int, timeout_s: float = 180.0) -> None:
        self.wait(lambda: True if self.newest_step() >= step else None, timeout_s, f"step {step} on every rank")

    def finish(self, timeout_s: float = 120.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"the job did not end within {timeout_s:.0f} s") from None

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its session is left
        except ProcessLookupError:
            pass
        self.proc.wait()

    def last_lines(self, n: int = 3) -> str:
        lines = [x.strip() for x in self.console.read_text(errors="replace").splitlines() if x.strip()]
        return " | ".join(lines[-n:])[-400:] or "(no output)"

    def events(self) -> list[dict[str, Any]]:
        return read_status(self.run_dir, recent=10000)["events"]


def first_start(rows: dict[int, list[Row]], nranks: int, match: Callable[[Row], bool]) -> float | None:
    """When the last rank started its first step that ``match``es (None while some rank has none yet)."""
    firsts = []
    for rank in range(nranks):
        found = next((r.started for r in rows.get(rank, []) if match(r)), None)
        if found is None:
            return None
        firsts.append(found)
    return max(firsts)


def step_time(rows: dict[int, list[Row]]) -> float:
    """Median seconds between consecutive step starts of one rank, within a round, over every rank."""
    gaps = sorted(b.started - a.started for r in rows.values() for a, b in zip(r, r[1:]) if a.round_id == b.round_id)
    return gaps[len(gaps) // 2] if gaps else 0.0


def same_step(rows: dict[int, list[Row]], versions: list[dict[str, Any]]) -> tuple[int, int, list[str], int]:
    """Each rank's (step -> values) against the versions: (rank-version switches at the version's at_step, of
    how many, what went wrong, the step count every rank ran). A rank runs each step 0..N-1 exactly once."""
    live = sorted((v for v in versions if v["status"] != "reverted"), key=lambda v: v["number"])
    problems: list[str] = []
    ok = total = 0
    counts = set()
    for rank, rank_rows in sorted(rows.items()):
        steps = [r.step for r in rank_rows]
        counts.add(len(steps))
        if steps != list(range(len(steps))):
            lost = sorted(set(range(max(steps) + 1)) - set(steps))
            redone = len(steps) - len(set(steps))
            problems.append(f"rank {rank}: {len(lost)} steps lost, {redone} redone")
        by_step = {r.step: r for r in rank_rows}
        for version in live[1:]:
            shown = {k: v for k, v in version["changed"].items() if k in ("lr", "batch_size")}
            if not shown:
                continue
            total += 1
            at = version["at_step"]
            later = [v for v in live if v["number"] > version["number"] and v["at_step"] <= at]
            row, before = by_step.get(at), by_step.get(at - 1)
            want = effective_values(live, at)
            was = effective_values(live, at - 1)
            if later or row is None:
                problems.append(f"rank {rank}: v{version['number']} not run (step {at} absent or replaced)")
                continue
            if (row.lr, row.batch) == (want["lr"], want["batch_size"]) and \
                    (before is None or (before.lr, before.batch) == (was["lr"], was["batch_size"])):
                ok += 1
            else:
                first = next((r.step for r in rank_rows if (r.lr, r.batch) == (want["lr"], want["batch_size"])), None)
                problems.append(f"rank {rank}: v{version['number']} due at {at}, first run at {first}")
    return ok, total, problems, min(counts) if counts else 0


def effective_values(live: list[dict[str, Any]], step: int) -> dict[str, Any]:
    due = [v for v in live if v["at_step"] <= step]
    return max(due, key=lambda v: v["number"])["values"] if due else live[0]["values"]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
