"""A node's fork server failing under ``convoy run``: SIGSTOPped, then one of its workers SIGKILLed, the job names
the killed rank, kills the server for not answering and goes on with a fresh one (it hung for as long as the
server stayed stopped); SIGKILLed in a job of roles, its processes are placed again on a fresh server, the job
spends no role's restart and says what happened in one line."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from helpers import REPO, Launched, ProcessScope, fixture, wait_for

pytestmark = pytest.mark.slow
WORKER = str(REPO / "tests" / "fixtures" / "worker.py")
ROLE_SCRIPT = fixture("role_train.py")


def round_pids(records: Path, round_id: int) -> list[int]:
    files = [records / f"rank{rank}.round{round_id}.pid" for rank in range(2)]
    wait_for(lambda: all(f.exists() for f in files), 60, f"both workers of round {round_id}")
    return [int(f.read_text()) for f in files]


def parent_of(records: Path, rank: int, round_id: int) -> int:
    return json.loads((records / f"rank{rank}.round{round_id}.json").read_text())["ppid"]


def test_a_stopped_fork_server_is_replaced_and_the_rank_killed_under_it_is_named(procs: ProcessScope,
                                                                                  run_dir: Path,
                                                                                  tmp_path: Path) -> None:
    records = tmp_path / "records"
    records.mkdir()
    job = procs.start(["run", "--nnodes", 1, "--nproc-per-node", 2, "--preload", "json", "--stop-grace", 1,
                       "--run-dir", run_dir, WORKER, "--record", records, "--hold-first", 60])
    first = round_pids(records, 1)
    server = parent_of(records, 0, 1)
    os.kill(server, signal.SIGSTOP)
    os.kill(first[1], signal.SIGKILL)
    round_pids(records, 2)
    result = job.wait(60)
    assert result.returncode == 0, result.explain()
    assert "convoy: rank 1 (node 0, local rank 1) was killed by SIGKILL in round 1" in result.stdout, \
        result.explain()
    assert re.search(r"the fork server of node local0 did not answer in \d+ s; a fresh one takes its place",
                     result.output), result.explain()
    assert {parent_of(records, rank, 2) for rank in range(2)} != {server}, "round 2 forks from the fresh server"
    assert not psutil.pid_exists(server), "the stopped server was killed and reaped"
    assert procs.wait_no_leftovers() == []


def role_job(procs: ProcessScope, run_dir: Path, go: Path) -> tuple[Launched, Callable[[], list[dict]]]:
    """A job of one PS and two workers forked from one server, each holding until ``go`` exists; and what its
    processes recorded of themselves so far."""
    job = procs.start(["run", "--ps", "1", "--workers", "2", "--preload", "json", "--stop-grace", "1",
                       "--run-dir", str(run_dir), ROLE_SCRIPT, "--hold-until", str(go)])
    path = run_dir / "role_records.jsonl"

    def seen() -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return job, seen


def test_a_killed_fork_server_of_a_job_of_roles_costs_no_restart(procs: ProcessScope, run_dir: Path,
                                                                  tmp_path: Path) -> None:
    go = tmp_path / "go"
    job, seen = role_job(procs, run_dir, go)
    wait_for(lambda: len(seen()) == 3, 60, "the PS and both workers to run")
    servers = {psutil.Process(record["pid"]).ppid() for record in seen()}
    assert len(servers) == 1, seen()
    server = servers.pop()
    os.kill(server, signal.SIGKILL)
    wait_for(lambda: len(seen()) == 6, 60, "the three processes to start again")
    again = seen()[3:]
    assert sorted((r["role"], r["rank"], r["incarnation"] > 0) for r in again) == \
        [("ps", 0, True), ("worker", 0, True), ("worker", 1, True)], again
    fresh = {psutil.Process(r["pid"]).ppid() for r in again}
    assert len(fresh) == 1 and fresh != {server}, "all three forked from one fresh server"
    assert all("convoy.agent.forkserver" in r["parent"] for r in again), again
    go.touch()
    result = job.wait(60)
    assert result.returncode == 0, result.explain()
    assert "convoy: job succeeded: every role finished (ps x1, worker x2)" in result.stdout, result.explain()
    assert not re.search(r"restart \d+ of|restarts the whole job|failed \(", result.stdout), \
        "no role spent a restart: " + result.explain()
    fault = "the fork server of node local0 died"  # the launcher started it: its signal is the launcher's to see
    assert result.stderr.count(f"{fault}; a fresh one takes its place") == 1, result.explain()
    assert len([line for line in result.stdout.splitlines() if fault in line]) == 1, \
        "the master names the fault in one line: " + result.explain()
    assert not psutil.pid_exists(server), "the dead server was reaped"
    assert procs.wait_no_leftovers() == []


def test_a_stopped_fork_server_of_a_job_of_roles_is_replaced_once_a_restart_needs_it(procs: ProcessScope,
                                                                                    run_dir: Path,
                                                                                    tmp_path: Path) -> None:
    """The worker SIGKILLed under the stopped server fails on its own (one restart of its role); its restart finds
    the server not answering: it is killed with the PS and the other worker, which start again on a fresh one
    as one infrastructure fault."""
    go = tmp_path / "go"
    job, seen = role_job(procs, run_dir, go)
    wait_for(lambda: len(seen()) == 3, 60, "the PS and both workers to run")
    worker0 = next(r["pid"] for r in seen() if (r["role"], r["rank"]) == ("worker", 0))
    server = psutil.Process(worker0).ppid()
    os.kill(server, signal.SIGSTOP)
    os.kill(worker0, signal.SIGKILL)
    wait_for(lambda: len(seen()) == 6, 60, "the three processes to start again")
    assert {psutil.Process(r["pid"]).ppid() for r in seen()[3:]} != {server}
    go.touch()
    result = job.wait(60)
    assert result.returncode == 0, result.explain()
    assert "convoy: worker 0 failed (was killed by SIGKILL); restarting only it (restart 1 of 3 for role worker)" \
        in result.stdout, result.explain()
    fault = re.search(r"infrastructure fault: (the fork server of node local0 did not answer in \d+ s);",
                      result.stdout)
    assert fault is not None, result.explain()
    assert result.stderr.count(f"{fault.group(1)}; a fresh one takes its place") == 1, result.explain()
    assert not psutil.pid_exists(server), "the stopped server was killed and reaped"
    assert procs.wait_no_leftovers() == []
