"""RoleProcesses on real processes: every exit of a role process is reported once with its incarnation, the older
incarnation the agent stops to make room for a newer one of its rank included (a restart placed on the same node
and port; a rank scaled down and at once up again); the processes ended at the job's end each get their exit
report too (the agent does not send those: the job's books are closed)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import wait_for

from convoy.agent.role_procs import JobContext, RoleProcesses
from convoy.config import WorkerConfig
from convoy.control.protocol import messages as p

pytestmark = pytest.mark.slow


@pytest.fixture
def processes(tmp_path: Path) -> RoleProcesses:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(60)\n")
    context = JobContext("j-procs", "n0", "127.0.0.1", tmp_path, "127.0.0.1:1")
    running = RoleProcesses(WorkerConfig(entrypoint=str(script), stop_grace_s=1), context)
    yield running
    running.stop_all()


def assignment(incarnation: int, rank: int = 0) -> p.RoleAssignment:
    return p.RoleAssignment(role="worker", rank=rank, incarnation=incarnation, world_size=2)


def wait_running(processes: RoleProcesses, rank: int = 0) -> None:
    log = processes.context.run_dir / "logs" / "roles" / f"worker{rank}.log"
    wait_for(lambda: log.exists() and "sleeping" in log.read_text(), 30, f"worker {rank} to run")


def exits_until_quiet(processes: RoleProcesses, seconds: float = 1.5) -> list[p.RoleReport]:
    """What ``poll`` reports over a while (long enough for a stop's SIGKILL to have come and gone)."""
    reports: list[p.RoleReport] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        reports += [report for _, report in processes.poll()]
        time.sleep(0.02)
    return reports


def exited(reports: list[p.RoleReport]) -> list[tuple[int, int, str | None]]:
    return [(r.rank, r.incarnation, r.signal) for r in reports if r.state == "exited"]


def test_an_older_incarnation_stopped_to_make_room_is_reported_once_before_the_newer_starts(
        processes: RoleProcesses) -> None:
    processes.carry_out([assignment(0)], [])
    wait_running(processes)
    reports = processes.carry_out([assignment(1)], [])
    assert [(r.incarnation, r.state) for r in reports] == [(0, "exited"), (1, "started")], reports
    assert exited(reports) == [(0, 0, "SIGTERM")]
    assert reports[0].log_tail == ["sleeping"], "its report carries its last lines"
    assert exited(exits_until_quiet(processes)) == [], "reported once"


def test_a_rank_scaled_down_and_at_once_up_again_reports_the_stopped_incarnation_once(
        processes: RoleProcesses) -> None:
    processes.carry_out([assignment(0), assignment(0, rank=1)], [])
    wait_running(processes)
    wait_running(processes, rank=1)
    stop = p.RoleStop(role="worker", rank=1, incarnation=0, reason="scaled down")
    reports = processes.carry_out([assignment(1, rank=1)], [stop])
    reports += exits_until_quiet(processes)
    assert exited(reports) == [(1, 0, "SIGTERM")], reports
    assert [(r.rank, r.incarnation) for r in reports if r.state == "started"] == [(1, 1)]


def test_the_processes_ended_at_the_jobs_end_each_get_their_exit_report(processes: RoleProcesses) -> None:
    processes.carry_out([assignment(0), assignment(0, rank=1)], [])
    wait_running(processes)
    wait_running(processes, rank=1)
    reports = processes.stop_all()
    assert sorted(exited(reports)) == [(0, 0, "SIGTERM"), (1, 0, "SIGTERM")], reports
    assert processes.running == {}
