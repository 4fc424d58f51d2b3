"""Jobs for benchmarks/faults.py: the step files they write, the processes they start, cleanup.

Every process a job starts carries ``CONVOY_FAULTS_TAG=<unique>`` in its environment (agents,
standbys and workers inherit it), so ``Job.stop()`` finds and kills all of them, even those
whose parent died first, and no run leaves anything behind.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import psutil
from steplog import StepLog
from warm import agent_is_warm

TRAIN = Path(__file__).resolve().parent / "fault_train.py"
TAG_VAR = "CONVOY_FAULTS_TAG"
POLL_S = 0.05
LEFTOVERS: list[str] = []
"""What a job left behind and ``Job.stop()`` had to remove (segments) or could not kill (pids)."""
HANGS_DIR = Path("/tmp/convoy-faults-hangs")
"""Where the stacks of a run that hung are written (``Job.dump_stacks``)."""
T = TypeVar("T")


def tagged_env(tag: str) -> dict[str, str]:
    return {**os.environ, TAG_VAR: tag, "PYTHONUNBUFFERED": "1"}


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Every live process that carries this job's tag in its environment."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(TAG_VAR) == tag:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def command_line(proc: psutil.Process) -> list[str]:
    """The process's command line ([] once it is gone)."""
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def read_state(run_dir: Path) -> dict[str, object] | None:
    """The job row and the last round's members from the master's state.db (None before it exists)."""
    path = run_dir / "state.db"
    if not path.is_file():
        return None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2)
        try:
            job = db.execute("SELECT job_id, master_url, status FROM job").fetchone()
            members = db.execute("SELECT members FROM rounds ORDER BY round_id DESC LIMIT 1").fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return None
    if job is None:
        return None
    return {"job_id": job[0], "master_url": job[1], "status": job[2], "members": members[0] if members else "[]"}


def master_serving(url: str, token: str, timeout_s: float = 0.5) -> bool:
    """Whether the master at HOST:PORT answers an authorized GET /v1/status with 200."""
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("GET", "/v1/status", headers={"Authorization": f"Bearer {token}"})
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class Job:
    """One job in its own directory; subclasses start it. ``stop()`` ends every process it started."""

    def __init__(self, tmp: Path, nodes: int) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp, self.out, self.run_dir = tmp, tmp / "steps", tmp / "run"
        self.console = tmp / "console.log"
        self.nodes = nodes
        self.tag = uuid.uuid4().hex
        self.steps = StepLog(self.out)
        self.main: subprocess.Popen[bytes] | None = None
        self.known: dict[int, psutil.Process] = {}
        self.job_id = ""

    def train_args(self, sleep_s: float, seed: int, extra: Sequence[str] = ()) -> list[str]:
        return [str(TRAIN), "--out", str(self.out), "--sleep", str(sleep_s), "--seed", str(seed), *extra]

    def spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.console, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=tagged_env(self.tag), start_new_session=True)
        self.known[proc.pid] = psutil.Process(proc.pid)
        return proc

    def alive(self) -> bool:
        return self.main is not None and self.main.poll() is None

    def exit_code(self) -> int | None:
        return None if self.main is None else self.main.poll()

    def agents(self) -> list[psutil.Process]:
        raise NotImplementedError

    def token(self) -> str:
        return (self.run_dir / "token").read_text().strip()

    def master_url(self) -> str | None:
        state = read_state(self.run_dir)
        if state is None:
            return None
        self.job_id = str(state["job_id"])
        return str(state["master_url"])

    def node_holding(self, node_rank: int) -> str | None:
        """The id of the node that has ``node_rank`` in the latest round."""
        state = read_state(self.run_dir)
        members = json.loads(str(state["members"])) if state else []
        return next((str(node_id) for rank, node_id, _host, _nproc in members if rank == node_rank), None)

    def standbys_warm(self) -> bool:
        """Every agent can start its next workers without an import (its fork server, or a standby, is warm)."""
        workers = {s.pid for s in self.steps.current().values()}
        agents = self.agents()
        return bool(agents) and all(agent_is_warm(agent, workers, 1) for agent in agents)

    def ready(self, settle_s: float, warm: bool) -> bool:
        """Every rank has trained ``settle_s`` with its current worker (and, if asked, standbys are warm)."""
        current = self.steps.current()
        if len(current) < self.nodes:
            return False
        for rank, latest in current.items():
            first = next(s for s in self.steps.steps if s.rank == rank and s.pid == latest.pid)
            if latest.t - first.t < settle_s or time.time() - latest.t > 2.0:
                return False
        return not warm or self.standbys_warm()

    def request_stop(self, margin: int = 20) -> None:
        """Ask the job to end at a step no rank has reached yet."""
        tmp = self.out / "stop_at.tmp"
        tmp.write_text(str(self.steps.last_step() + margin))
        tmp.replace(self.out / "stop_at")

    def track(self) -> None:
        for root in list(self.known.values()):
            try:
                for child in root.children(recursive=True):
                    self.known.setdefault(child.pid, child)
            except psutil.Error:
                continue

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the main process, then SIGKILL whatever of this job is left; unlink its segments.

        After a job that ended on its own, what is still running a few seconds later, and any
        snapshot segment of the job, is recorded in LEFTOVERS (convoy should have cleaned it up).
        """
        self.master_url()  # learn the job id for the shared-memory cleanup
        self.track()
        ended_alone = self.main is not None and self.main.poll() is not None
        if ended_alone:
            _gone, orphans = psutil.wait_procs(tagged_processes(self.tag), timeout=5)
            LEFTOVERS.extend(f"pid {p.pid} ({' '.join(command_line(p))[:80]})" for p in orphans)
        elif self.main is not None:
            self.main.send_signal(signal.SIGTERM)
            try:
                self.main.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        left = {p.pid: p for p in [*self.known.values(), *tagged_processes(self.tag)]}
        for proc in left.values():
            try:
                proc.kill()  # psutil checks that the pid still names the same process
            except psutil.Error:
                pass
        _gone, alive = psutil.wait_procs(list(left.values()), timeout=5)
        LEFTOVERS.extend(f"pid {p.pid} survived SIGKILL" for p in alive)
        if self.job_id:
            for path in Path("/dev/shm").glob(f"convoy-{self.job_id}-*"):
                if ended_alone:
                    LEFTOVERS.append(str(path))
                path.unlink(missing_ok=True)

    def dump_stacks(self) -> str:
        """Where the Python stacks of this job's processes now are written (py-spy), for a run that hung."""
        self.track()
        HANGS_DIR.mkdir(parents=True, exist_ok=True)
        path = HANGS_DIR / f"{self.tag}.txt"
        with open(path, "w") as out:
            for proc in {p.pid: p for p in [*self.known.values(), *tagged_processes(self.tag)]}.values():
                try:
                    out.write(f"== pid {proc.pid}: {' '.join(command_line(proc))[:160]}\n")
                    out.flush()
                    subprocess.run(["py-spy", "dump", "--pid", str(proc.pid)], stdout=out, stderr=subprocess.STDOUT,
                                   timeout=20, check=False)
                except (OSError, subprocess.TimeoutExpired, psutil.Error) as exc:
                    out.write(f"   (no stack: {exc})\n")
        return str(path)

    def state_rows(self, query: str, *params: object) -> list[tuple[object, ...]]:
        """Rows of a read-only query on the master's state.db ([] while it is missing or locked)."""
        path = self.run_dir / "state.db"
        if not path.is_file():
            return []
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2)
            try:
                return db.execute(query, params).fetchall()
            finally:
                db.close()
        except sqlite3.Error:
            return []

    def last_error(self) -> str:
        """The console's last line that names an error (else its last line), shortened."""
        lines = [ln.strip() for ln in self.console.read_text(errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if "rror" in ln or "Traceback" in ln]
        return (errors or lines or ["(no output)"])[-1][:200]


class LocalJob(Job):
    """``convoy run`` with N local agents of one worker each: ``options`` go to ``convoy run``,
    ``train_extra`` to fault_train.py, and ``wrap`` is a command the launcher runs under (``unshare``)."""

    def __init__(self, tmp: Path, elastic: bool, sleep_s: float, seed: int, options: Sequence[str] = (),
                 train_extra: Sequence[str] = (), wrap: Sequence[str] = ()) -> None:
        super().__init__(tmp, nodes=2)
        nnodes = ["--nnodes", "1:2", "--relaunch", "--rdzv-wait", "30"] if elastic else ["--nnodes", "2"]
        argv = [*wrap, sys.executable, "-m", "convoy", "run", *nnodes, "--nproc-per-node", "1", "--stop-grace", "2",
                "--max-restarts", "5", *options, "--run-dir", str(self.run_dir),
                *self.train_args(sleep_s, seed, train_extra)]
        self.main = self.spawn(argv)
        self._launcher: psutil.Process | None = None if wrap else self.known[self.main.pid]

    @property
    def launcher(self) -> psutil.Process:
        """The ``convoy run`` process (below the wrapper, where there is one)."""
        if self._launcher is None:
            try:
                below = psutil.Process(self.main.pid).children(recursive=True) if self.main else []
            except psutil.Error:
                below = []
            self._launcher = next((p for p in below if {"convoy", "run"} <= set(command_line(p))), None)
        return self._launcher or self.known[self.main.pid]  # type: ignore[union-attr]

    def child(self, *words: str) -> psutil.Process | None:
        """The launcher's child whose command line holds every word."""
        try:
            for child in self.launcher.children():
                if all(word in child.cmdline() for word in words):
                    return child
        except psutil.Error:
            pass
        return None

    def agents(self) -> list[psutil.Process]:
        try:
            return [c for c in self.launcher.children() if "agent" in c.cmdline()]
        except psutil.Error:
            return []


def wait_for(job: Job, probe: Callable[[], T | None], timeout_s: float, until_exit: bool = True) -> T | None:
    """Poll ``probe`` (after reading the step files) until it returns a value, the job exits, or time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        job.steps.poll()
        job.track()
        value = probe()
        if value is not None or time.monotonic() > deadline or (until_exit and not job.alive()):
            return value
        time.sleep(POLL_S)
