"""What every fault case of benchmarks/faults.py shares: the outcome a run records, its time bound, and the
steps around a fault (wait until the job trains, finish it, read its events and restarts from the state)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
from fault_job import Job, wait_for
from steplog import first

RUN_BOUND_S = 240.0
"""The most a run may take from the job's start to its exit; past it the run counts as hung."""
WAIT_S = {"ready": 120.0, "event": 30.0, "train": 60.0, "exit": 60.0}


@dataclass
class CaseOutcome:
    recovered: bool
    """The fault had its defined outcome (named so the matrix prints it like the original faults')."""
    lost: int
    recover_s: float | None
    """Fault -> the outcome (readmitted, excluded, resumed, ended)."""
    pause_s: float | None
    ended: bool
    """The job exited within the run's bound."""
    result: str
    """Which outcome: finished, failed (with its line), or what went wrong."""
    detail: str = ""
    redone: int = 0
    """``full_dev_shm``: finished steps done again since the last persistent save (expected there)."""
    restarts: int = 0
    """The fork-server faults: restarts spent beyond those the injected fault must spend."""


def finish(job: Job, began: float) -> tuple[int | None, bool]:
    """A second more of training, then ask the job to end; (exit code, ended within the run's bound)."""
    settled = time.time() + 1.0
    wait_for(job, lambda: first(job.steps.steps, lambda s: s.t > settled), 20.0)
    if job.alive():
        job.request_stop()
    left = max(1.0, min(WAIT_S["exit"], began + RUN_BOUND_S - time.monotonic()))
    code = wait_for(job, job.exit_code, left)
    job.steps.poll()
    return code, code is not None


def ended_text(code: int | None, job: Job) -> str:
    if code is None:
        return f"hung: still running {RUN_BOUND_S:.0f} s after it started (stacks in {job.dump_stacks()})"
    return "finished" if code == 0 else f"failed (exit {code}): {job.last_error()}"


def event_time(job: Job, kind: str, words: str, after: float) -> float | None:
    rows = job.state_rows("SELECT ts FROM events WHERE kind = ? AND message LIKE ? AND ts > ? ORDER BY id LIMIT 1",
                          kind, f"%{words}%", after)
    return float(rows[0][0]) if rows else None  # type: ignore[arg-type]


def restart_count(job: Job) -> int:
    rows = job.state_rows("SELECT restart_count FROM job")
    return int(rows[0][0]) if rows else 0  # type: ignore[call-overload]


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def broken(job: Job, why: str) -> CaseOutcome:
    return CaseOutcome(False, 0, None, None, True, f"could not inject: {why}")


def guarded(job: Job, body: Callable[[float], CaseOutcome]) -> CaseOutcome:
    """Wait until the job trains, run ``body``; always stop the job. A job that never trains is a failed run."""
    began = time.monotonic()
    try:
        if not wait_for(job, lambda: job.ready(2.0, False) or None, WAIT_S["ready"]):
            code = job.exit_code()
            return CaseOutcome(False, 0, None, None, code is not None, f"never trained: {job.last_error()}")
        try:
            return body(began)
        except (RuntimeError, KeyError, psutil.Error) as exc:
            return CaseOutcome(False, 0, None, None, job.exit_code() is not None, f"could not inject: {exc!r}")
    finally:
        job.stop()
