"""The fork-server faults of issue 47 that benchmarks/faults.py adds to its matrix, on its seeded 2-node DDP job.

``forkserver_kill``: SIGKILL the fork server that forked one node's worker while the job trains. The worker dies
with it; the agent starts a fresh server and reports one infrastructure fault: the same two nodes regroup in a
new round, and no restart is spent. ``forkserver_stop``: SIGSTOP that server, then SIGKILL its worker. The kill
is a real failure and spends the one restart it must; the new round needs a fork the stopped server never
answers, so after the agent's bound (10 s) the server is killed with its children and replaced (one line), and the
round's worker is forked from the fresh one: nothing more is spent. The server is never sent SIGCONT: a server that
stays stopped (a frozen cgroup, a debugger, a stall that does not end) is the case the agent's bound is there for;
one woken in time would just answer. Outcome of both: exit 0, 0 steps lost, the time from the fault to the first
step of a later round, the fault named in one line, the old server gone, and the restarts spent beyond the
injected kill (read from the master's state), which must be 0.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from fault_job import LocalJob, wait_for
from fault_outcome import CaseOutcome, ended_text, finish, fmt, guarded, restart_count
from steplog import first, steps_lost

FORKSERVER_CASES = ("forkserver_kill", "forkserver_stop")
FORK_SERVER = "convoy.agent.forkserver"
EXPECTED_RESTARTS = {"forkserver_kill": 0, "forkserver_stop": 1}
"""Restarts the injected fault must spend: the SIGKILLed worker's own under a stopped server; none for the rest."""
WAIT_TRAIN_S = 90.0
"""A stopped server costs the agent's 10 s bound, then a fresh server's import of torch, before training resumes."""


def server_of(pid: int) -> psutil.Process:
    """The fork server a worker was forked from (its parent), checked by its command line."""
    parent = psutil.Process(pid).parent()
    if parent is None or FORK_SERVER not in " ".join(parent.cmdline()):
        raise RuntimeError(f"worker {pid} was not forked by a fork server (parent {parent})")
    return parent


def run_forkserver_kill(tmp: Path, index: int, sleep_s: float, seed: int) -> CaseOutcome:
    job = LocalJob(tmp, elastic=False, sleep_s=sleep_s, seed=seed)
    return guarded(job, lambda began: _forkserver_fault(job, index, began, stop=False))


def run_forkserver_stop(tmp: Path, index: int, sleep_s: float, seed: int) -> CaseOutcome:
    job = LocalJob(tmp, elastic=False, sleep_s=sleep_s, seed=seed)
    return guarded(job, lambda began: _forkserver_fault(job, index, began, stop=True))


def _forkserver_fault(job: LocalJob, index: int, began: float, stop: bool) -> CaseOutcome:
    fault = "forkserver_stop" if stop else "forkserver_kill"
    rank = index % 2
    fault_round = max(s.round_id for s in job.steps.steps)
    worker = job.steps.current()[rank].pid
    server = server_of(worker)
    before = restart_count(job)
    at = time.time()
    if stop:
        server.suspend()
        psutil.Process(worker).send_signal(signal.SIGKILL)
    else:
        server.send_signal(signal.SIGKILL)
    resumed = wait_for(job, lambda: first(job.steps.steps, lambda s: s.t > at and s.round_id > fault_round),
                       WAIT_TRAIN_S)
    code, ended = finish(job, began)
    spent = restart_count(job) - before
    extra = spent - EXPECTED_RESTARTS[fault]
    lost = steps_lost(job.steps.steps)
    named = _infrastructure_named(job, at, stop)
    survived = _alive(server)
    ok = code == 0 and resumed is not None and lost == 0 and extra == 0 and named and not survived
    result = ended_text(code, job) if code != 0 else (
        "did not train again" if resumed is None else
        f"{spent} restart(s) spent, {EXPECTED_RESTARTS[fault]} expected" if extra else
        "no infrastructure fault was named" if not named else
        "the old fork server is still running" if survived else "finished")
    what = "stopped, its worker killed" if stop else "killed"
    return CaseOutcome(ok, lost, None if resumed is None else resumed.t - at, None, ended, result,
                       f"node rank {rank}'s fork server {server.pid} {what}; {spent} restart(s) spent; trained again "
                       f"in round {resumed.round_id if resumed else '-'} after "
                       f"{fmt(resumed.t - at if resumed else None)} s", restarts=extra)


def _alive(proc: psutil.Process) -> bool:
    """Still running (a zombie not reaped yet counts as gone: it runs nothing)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _infrastructure_named(job: LocalJob, after: float, stop: bool) -> bool:
    """Whether the fault was named: the agent's one line on the replaced server, and for a killed server, whose
    worker died with it, the master's regroup for an infrastructure fault (a stopped one ended no process of the
    new round: the agent replaced it before the fork)."""
    said = "did not answer in" if stop else "died; a fresh one takes its place"
    if said not in job.console.read_text(errors="replace"):
        return False
    if stop:
        return True
    rows = job.state_rows("SELECT count(*) FROM events WHERE kind = 'regroup' AND message LIKE ? AND ts > ?",
                          "%infrastructure fault%no restart spent%", after)
    return bool(rows) and int(rows[0][0]) >= 1  # type: ignore[call-overload]


RUN_FORKSERVER: dict[str, Callable[[Path, int, float, int], CaseOutcome]] = {
    "forkserver_kill": run_forkserver_kill, "forkserver_stop": run_forkserver_stop,
}
