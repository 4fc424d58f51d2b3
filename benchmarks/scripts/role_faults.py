"""Faults of the infrastructure and of membership in a job of roles (issue 47): examples/train_ps.py, 2 parameter
servers and its workers, one fault injected once a third of the epoch's pushes are in (a sixth for the scaling).

``whole_job_restart``: the worker role's policy is restart-job (a job file sets it); worker 0 or 1 SIGKILLed: every
process stops and starts as a new incarnation, the servers restored from their snapshots. ``lost_node``: 8 workers
over 2 nodes (``--nnodes 1:2``), one node's agent SIGKILLed: its processes (a PS among them) start again on the other
node. ``forkserver_kill``: the node's fork server SIGKILLed: its processes start again from a fresh one.
``forkserver_stop``: the fork server SIGSTOPped (never woken: a server that stays stopped is what the agent's 10 s
bound is for) and a worker SIGKILLed under it: the worker's restart finds the server mute, which is killed with its
children and replaced. ``scale_down_up``: ``--workers 2:3`` scaled to 3, then, once worker 2 trains, to 2 and at
once to 3 again (one ``convoy scale`` call): worker 2's process is stopped and a new one started.

Counted per run: the job ends within the bound with exit 0 (or fails with one line naming the cause, reported as
such); the chief's exactly-once count holds (every batch applied once on every server: none lacking, none applied
twice); the role restarts spent (``finished ... with N restart(s)``) are the injected failure's own (1 for the
SIGKILLed worker of restart-job and of the stopped server, 0 for the rest: a lost node, a dead fork server and a
scaling spend none); recover: the fault to the last process it ended running again (its ``role_started``); and
nothing of the job is left running, no /dev/shm segment of it left.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from fault_job import command_line, read_state, tagged_env, tagged_processes
from ps_faults import ARGS, AUC, EXAMPLE, REPO, STEPS, Job, ps_status, role_pid

from convoy.control.store import read_status

CASES = ("whole_job_restart", "lost_node", "forkserver_kill", "forkserver_stop", "scale_down_up")
EXPECTED_RESTARTS = {"whole_job_restart": 1, "lost_node": 0, "forkserver_kill": 0, "forkserver_stop": 1,
                     "scale_down_up": 0}
"""Role restarts the injected fault must spend: a SIGKILLed worker's own; an infrastructure fault or a scaling none."""
BATCHES = 2 * STEPS
RUN_BOUND_S = 180.0
"""From the job's start to its exit; a fault-free run takes about 20 s here. Past it the run counts as hung."""
WAIT_S = 120.0
EXACT = re.compile(r"\[worker0\]: exactly once: each of the (\d+) batches applied once on each of (\d+) servers")
NOT_EXACT = re.compile(r"\[worker0\]: batches NOT trained exactly once: (.*)")
REPAIRED = re.compile(r"\[worker0\]: trained (\d+) batches again that a server had lost")
RESTARTS = re.compile(r"convoy: finished in [\d.]+ s with (\d+) restart\(s\)")
FAILED = ("convoy: job failed:", "convoy: error:")


@dataclass
class RoleOutcome:
    code: int | None
    """The job's exit code; None: still running at the bound (hung)."""
    finished: bool
    exact: bool
    lost: int | None
    """Batch tags some server lacks at the end, summed over the servers (None: the chief printed no count)."""
    twice: int | None
    """Pushes a server applied beyond one per batch it holds, summed over the servers (None: no count)."""
    restarts: int | None
    """Role restarts spent beyond the injected failure's own (None: the job did not say)."""
    recover_s: float | None
    result: str
    detail: str = ""
    repaired: int = 0
    """Batches the chief trained again after the epoch (a server had lost them with their worker)."""
    auc: float | None = None
    left: list[str] = field(default_factory=list)

    @property
    def good(self) -> bool:
        return self.finished and self.exact and self.restarts == 0 and self.recover_s is not None and not self.left


class RoleJob(Job):
    """``convoy run`` of the example with this case's roles, every process tagged to be found at the end."""

    def __init__(self, run_dir: Path, command: list[str]) -> None:
        self.tag = uuid.uuid4().hex
        self.began = time.monotonic()
        super().__init__(run_dir, command, tagged_env(self.tag))

    def output(self) -> str:
        return "".join(self.lines)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def finish(self) -> tuple[int | None, str, list[str]]:
        """Wait for the exit within the run's bound; (exit code or None if hung, output, what was left behind)."""
        try:
            code: int | None = self.proc.wait(max(1.0, self.began + RUN_BOUND_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(10)
        (self.run_dir.parent / "console.log").write_text(self.output())  # kept with the run dir of a run gone wrong
        return code, self.output(), self.leftovers(ended_alone=code is not None)

    def leftovers(self, ended_alone: bool) -> list[str]:
        """Kill what of this job still runs (5 s after an exit of its own: left behind) and unlink its segments."""
        found = tagged_processes(self.tag)
        _gone, alive = psutil.wait_procs(found, timeout=5 if ended_alone else 0)
        left = [f"pid {p.pid} ({' '.join(command_line(p))[:80]})" for p in alive if _running(p)] if ended_alone else []
        for proc in alive:
            try:
                proc.kill()  # SIGKILL ends a stopped process too
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        state = read_state(self.run_dir)
        for path in Path("/dev/shm").glob(f"convoy-{state['job_id']}-*") if state else []:
            left += [str(path)] if ended_alone else []
            path.unlink(missing_ok=True)
        return left


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (a zombie runs nothing; its parent, or init once the parent is gone, reaps it)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def until(job: RoleJob, probe: Callable[[], object], what: str, timeout: float = WAIT_S) -> object:
    """Poll ``probe`` until it returns something truthy; a RuntimeError if the job ends or time runs out first."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if not job.alive():
            raise RuntimeError(f"the job ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def pushes_in(job: RoleJob, count: int) -> Callable[[], bool]:
    return lambda: (ps_status(job.run_dir, 0) or {}).get("version", 0) >= count


def started(run_dir: Path) -> list[tuple[float, str, int, str, int]]:
    """(time, role, rank, node, pid) of every ``role_started`` event so far."""
    try:
        events = read_status(run_dir, recent=100_000)["events"]
    except (OSError, KeyError, ValueError, sqlite3.Error):  # not there yet, or being created
        return []
    found = [(e["ts"], re.match(r"(\w+) (\d+) is running at \S+ \((\S+), pid (\d+)\)", e["message"]))
             for e in events if e["kind"] == "role_started"]
    return [(ts, m[1], int(m[2]), m[3], int(m[4])) for ts, m in found if m]


def default_command() -> list[str]:
    return ["--ps", "2", "--workers", "2", "--stop-grace", "1", str(EXAMPLE), *ARGS]


def whole_job_command(tmp: Path) -> list[str]:
    """A job file: 2 servers, and 2 workers whose policy restarts the whole job."""
    path = tmp / "job.toml"
    quoted = ", ".join(f'"{arg}"' for arg in ARGS)
    path.write_text(f'ps = 2\nstop_grace = 1\nentrypoint = "{EXAMPLE}"\nargs = [{quoted}]\n\n'
                    '[roles.worker]\ncount = 2\nfailure_policy = "restart-job"\n')
    return [str(path)]


def kill_worker(job: RoleJob, index: int) -> tuple[float, str]:
    until(job, pushes_in(job, BATCHES // 3), f"{BATCHES // 3} pushes")
    rank = index % 2
    pid = until(job, lambda: role_pid(job.run_dir, "worker", rank), f"worker {rank}'s process")
    os.kill(int(pid), signal.SIGKILL)  # type: ignore[call-overload]
    return time.time(), f"worker {rank} SIGKILLed"


def kill_agent(job: RoleJob, index: int) -> tuple[float, str]:
    until(job, lambda: len(started(job.run_dir)) >= 10, "the 2 servers and 8 workers to start")
    until(job, pushes_in(job, BATCHES // 3), f"{BATCHES // 3} pushes")
    nodes = sorted({node for _, _, _, node, _ in started(job.run_dir)})
    if len(nodes) < 2:
        raise RuntimeError(f"every process was placed on {nodes}: no node to lose without losing the job")
    node = nodes[index % len(nodes)]
    agent = next((a for a in psutil.Process(job.proc.pid).children() if "agent" in a.cmdline()
                  and a.cmdline()[a.cmdline().index("--node-id") + 1] == node), None)
    if agent is None:
        raise RuntimeError(f"no agent of node {node}")
    on_it = sorted(f"{role} {rank}" for _, role, rank, where, _ in started(job.run_dir) if where == node)
    agent.kill()
    return time.time(), f"node {node}'s agent SIGKILLed ({', '.join(on_it)} on it)"


def worker_and_server(job: RoleJob, rank: int) -> tuple[psutil.Process, psutil.Process]:
    """Worker ``rank``'s process and the fork server it was forked from (its parent)."""
    pid = until(job, lambda: role_pid(job.run_dir, "worker", rank), f"worker {rank}'s process")
    worker = psutil.Process(int(pid))  # type: ignore[call-overload]
    server = worker.parent()
    if server is None or "convoy.agent.forkserver" not in " ".join(server.cmdline()):
        raise RuntimeError(f"worker {rank} (pid {pid}) was not forked by a fork server")
    return worker, server


def kill_fork_server(job: RoleJob, index: int) -> tuple[float, str]:
    until(job, pushes_in(job, BATCHES // 3), f"{BATCHES // 3} pushes")
    _worker, server = worker_and_server(job, index % 2)
    server.kill()
    return time.time(), f"fork server {server.pid} SIGKILLed"


def stop_fork_server(job: RoleJob, index: int) -> tuple[float, str]:
    until(job, pushes_in(job, BATCHES // 3), f"{BATCHES // 3} pushes")
    rank = index % 2
    worker, server = worker_and_server(job, rank)
    server.suspend()
    worker.kill()
    return time.time(), f"fork server {server.pid} SIGSTOPped, worker {rank} SIGKILLed under it"


def scale(job: RoleJob, *counts: str) -> None:
    done = subprocess.run([sys.executable, "-m", "convoy", "scale", "--run-dir", str(job.run_dir), *counts],
                          capture_output=True, text=True, env={**tagged_env(job.tag), "PYTHONPATH": str(REPO)},
                          timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"convoy scale {' '.join(counts)}: {(done.stderr or done.stdout).strip()[-200:]}")


def scale_down_up(job: RoleJob, index: int) -> tuple[float, str]:
    """Up to 3 at a sixth of the pushes; once worker 2 has pushed, down to 2 and up to 3 in one call. The fault's
    time is the master's record of the scale-down."""
    until(job, pushes_in(job, BATCHES // 6), f"{BATCHES // 6} pushes")
    scale(job, "worker=3")
    until(job, lambda: (ps_status(job.run_dir, 0, (2,)) or {"by_worker": {2: 0}})["by_worker"][2] >= 5,
          "worker 2's first pushes")
    asked = time.time()
    scale(job, "worker=2", "worker=3")
    events = read_status(job.run_dir, recent=100_000)["events"]
    down = [e["ts"] for e in events if e["kind"] == "role_scaled" and "3 -> 2" in e["message"] and e["ts"] >= asked - 1]
    return (down[0] if down else asked), "worker scaled 3 -> 2 -> 3 in one convoy scale call, worker 2 training"


CASE_RUNS: dict[str, tuple[Callable[[Path], list[str]], Callable[[RoleJob, int], tuple[float, str]]]] = {
    "whole_job_restart": (whole_job_command, kill_worker),
    "lost_node": (lambda tmp: ["--nnodes", "1:2", "--rdzv-wait", "10", "--ps", "2", "--workers", "8", "--stop-grace",
                               "1", str(EXAMPLE), *ARGS], kill_agent),
    "forkserver_kill": (lambda tmp: default_command(), kill_fork_server),
    "forkserver_stop": (lambda tmp: default_command(), stop_fork_server),
    "scale_down_up": (lambda tmp: ["--ps", "2", "--workers", "2:3", "--stop-grace", "1", str(EXAMPLE), *ARGS],
                      scale_down_up),
}


def run_case(case: str, index: int, tmp: Path) -> RoleOutcome:
    """One run of ``case``: start the job, inject the fault, wait for the exit within the bound, judge it."""
    tmp.mkdir(parents=True)
    command, inject = CASE_RUNS[case]
    job = RoleJob(tmp / "run", command(tmp))
    try:
        at, detail = inject(job, index)
    except (RuntimeError, OSError, psutil.Error, sqlite3.Error) as exc:
        code, out, left = job.finish()
        return RoleOutcome(code, False, False, None, None, None, None, f"could not inject: {exc}", left=left)
    except BaseException:  # the benchmark itself broke, or was interrupted: end the job before going
        job.finish()
        raise
    code, out, left = job.finish()
    return judge(case, job.run_dir, at, detail, code, out, left)


def judge(case: str, run_dir: Path, at: float, detail: str, code: int | None, out: str,
          left: list[str]) -> RoleOutcome:
    exact, problems = EXACT.search(out), NOT_EXACT.search(out)
    lost = twice = None
    if exact or problems:
        text = problems.group(1) if problems else ""
        lost = sum(int(n) for n in re.findall(r"lacks (\d+) batches", text))
        twice = sum(int(n) for n in re.findall(r"applied (-?\d+) pushes beyond", text))
    is_exact = bool(exact) and int(exact.group(1)) == BATCHES and not problems
    spent = RESTARTS.search(out)
    restarts = int(spent.group(1)) if spent else None
    firsts: dict[tuple[str, int], float] = {}
    for ts, role, rank, _node, _pid in started(run_dir):
        if ts > at:
            firsts.setdefault((role, rank), ts)
    recover = max(firsts.values()) - at if firsts else None
    finished = code == 0 and "job succeeded" in out
    expected = EXPECTED_RESTARTS[case]
    result = ended(code, out) if code != 0 else (
        "batches NOT trained exactly once" if not is_exact else
        f"{restarts} role restart(s) spent, {expected} expected" if restarts != expected else
        "no process the fault ended ran again" if recover is None else
        f"{len(left)} processes or segments left behind" if left else "finished")
    repaired = REPAIRED.search(out)
    auc = AUC.search(out)
    return RoleOutcome(code, finished, is_exact, lost, twice, None if restarts is None else restarts - expected,
                       recover, result, detail, int(repaired.group(1)) if repaired else 0,
                       float(auc.group(1)) if auc else None, left)


def ended(code: int | None, out: str) -> str:
    """How a run that did not exit 0 ended: hung, or failed with the one line that names the cause (or not)."""
    if code is None:
        return f"hung: still running {RUN_BOUND_S:.0f} s after it started"
    reasons = [line for line in out.splitlines() if line.startswith(FAILED)]
    if len(reasons) == 1:
        return f"failed (exit {code}) with one line: {reasons[0][:160]}"
    return f"failed (exit {code}) with {len(reasons)} lines naming a cause; last line: {out.strip()[-160:]}"
