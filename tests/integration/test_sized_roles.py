"""Workers sized from one measured iteration, end to end on real processes (plain Python, no torch): with
``--workers auto`` the chief measures, the others start under the predicted limit (a real memory cgroup where
one is writable), status shows predicted vs measured; a worker past its limit is OOM-killed and relaunched with a
raised limit; a chief that crashes in the measuring iteration fails the job. The agent's side: the measuring
iteration's figures from a real process, and the watchdog's one warning. ``procs`` checks nothing outlives a test."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture

from convoy.agent.memory_limits import WATCHDOG, MemoryLimiter
from convoy.agent.role_memory import RoleMemory
from convoy.agent.role_procs import JobContext, RoleProcesses
from convoy.config import WorkerConfig
from convoy.control.protocol import messages as p

pytestmark = pytest.mark.slow

SCRIPT = fixture("sized_train.py")
MIB = 1024 * 1024
START_SLACK_S = 3.0
"""Every worker trains at most this long after the chief's measuring iteration ended (issue 24's target)."""


def run_args(run_dir: Path, *extra: object) -> list[str]:
    return ["run", "--ps", "1", "--workers", "auto", "--max-restarts", "0", "--preload", "", "--stop-grace", "1",
            "--run-dir", str(run_dir), SCRIPT, *map(str, extra)]


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "sized_records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def memory_table(run_dir: Path) -> dict:
    return json.loads((run_dir / "memory.json").read_text())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="an auto count takes one worker per CPU: needs 2")
def test_auto_workers_start_under_the_predicted_limit_and_status_shows_predicted_and_measured(
        procs: ProcessScope, run_dir: Path) -> None:
    result = procs.run(run_args(run_dir))
    assert result.returncode == 0, result.explain()
    assert "convoy: role worker: predicted" in result.stdout, result.explain()
    workers = sorted((r for r in records(run_dir) if r["role"] == "worker"), key=lambda r: r["rank"])
    assert len(workers) >= 2 and [r["rank"] for r in workers] == list(range(len(workers))), workers
    chief, others = workers[0], workers[1:]
    assert chief["limit"] == 0, "the chief was measured without a limit"
    table = {(row["role"], row["rank"]): row for row in memory_table(run_dir)["processes"]}
    for worker in others:
        row = table[("worker", worker["rank"])]
        assert row["limit_bytes"] > row["predicted_bytes"] > 0 and row["peak_bytes"] > 0, row
        if row["mechanism"] != WATCHDOG:
            assert worker["limit"] == row["limit_bytes"], "the process's own memory cgroup holds the limit"
        assert row["peak_bytes"] <= row["limit_bytes"]
        assert worker["training_at"] - chief["measured_at"] <= START_SLACK_S, "the workers start at once"
    status = procs.run(["status", "--run-dir", run_dir])
    assert status.returncode == 0, status.explain()
    lines = status.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("memory (MiB; margin"))
    assert lines[header + 1].split() == ["process", "predicted", "limit", "peak", "state"]
    row = next(line for line in lines[header:] if line.strip().startswith("worker 1 ("))
    predicted, limit, peak = (float(value) for value in row.split()[4:7])
    assert limit > predicted > 0 and peak > 0, row


def test_a_worker_past_its_limit_is_oom_killed_and_relaunched_with_a_raised_limit(procs: ProcessScope,
                                                                                  run_dir: Path) -> None:
    result = procs.run(run_args(run_dir, "--oom-once", 1))
    assert result.returncode == 0, result.explain()
    assert "convoy: worker 1 was OOM-killed at its limit" in result.stdout, result.explain()
    assert "not counted as a restart" in result.stdout and "with 0 restart(s)" in result.stdout
    table = [row for row in memory_table(run_dir)["processes"] if (row["role"], row["rank"]) == ("worker", 1)]
    killed, relaunched = table[0], table[-1]
    assert killed["state"] == "oom-killed" and relaunched["state"] == "exited", table
    assert relaunched["limit_bytes"] > killed["limit_bytes"]
    finished = [r for r in records(run_dir) if (r["role"], r["rank"]) == ("worker", 1)]
    assert len(finished) == 1 and finished[0]["incarnation"] == relaunched["incarnation"]
    if relaunched["mechanism"] != WATCHDOG:
        assert finished[0]["limit"] == relaunched["limit_bytes"]


def test_a_chief_that_crashes_in_the_measuring_iteration_fails_the_job(procs: ProcessScope, run_dir: Path) -> None:
    result = procs.run(run_args(run_dir, "--crash-measuring"))
    assert result.returncode != 0, result.explain()
    assert "convoy: job failed: worker 0 crashed in the measuring iteration (convoy.measure_iteration), which " \
           "sizes role worker: it exited with code 1; no other worker was started" in result.stdout, result.explain()
    assert [r["role"] for r in records(run_dir)] == ["ps"], "no worker got past the chief"
    assert procs.wait_no_leftovers() == []


ALLOCATING = textwrap.dedent("""
    import sys, time
    import convoy
    convoy.memory_baseline()
    state = bytearray(b"\\x01") * (16 << 20)
    with convoy.measure_iteration(batch_size=32, sample_bytes=1 << 20, state_bytes=16 << 20):
        batch = bytearray(b"\\x01") * (int(sys.argv[1]) << 20)
        time.sleep(0.2)
        del batch
    time.sleep(0.1)
""")


def assignment(rank: int, size_mib: int, limit: int, measure: bool) -> p.RoleAssignment:
    return p.RoleAssignment(role="worker", rank=rank, incarnation=rank, world_size=2, args=[str(size_mib)],
                            memory_limit_bytes=limit, measure=measure)


def run_processes(tmp_path: Path, memory: RoleMemory, sizes_mib: dict[int, tuple[int, int, bool]]
                  ) -> dict[int, p.RoleReport]:
    """Rank -> (MiB its batch takes, limit, measure); runs them to their ends, returns their exit reports."""
    script = tmp_path / "allocating.py"
    script.write_text(ALLOCATING)
    context = JobContext("j-sized", "n0", "127.0.0.1", tmp_path, "127.0.0.1:1")
    processes = RoleProcesses(WorkerConfig(entrypoint=str(script), stop_grace_s=1), context, memory=memory)
    for rank, (size, limit, measure) in sizes_mib.items():
        processes.start(assignment(rank, size, limit, measure))
    reports: dict[int, p.RoleReport] = {}
    deadline = time.monotonic() + 20
    try:
        while len(reports) < len(sizes_mib):
            assert time.monotonic() < deadline, "the processes did not end"
            for process, report in processes.poll():
                reports[process.assignment.rank] = report
            time.sleep(0.01)
    finally:
        processes.stop_all()
    return reports


def test_the_agent_measures_the_marked_iteration_and_reports_it_once(tmp_path: Path) -> None:
    memory = RoleMemory("n0")
    reports = run_processes(tmp_path, memory, {0: (64, 0, True)})
    assert reports[0].exitcode == 0, reports[0].log_tail
    sent = memory.report(time.monotonic())
    assert sent is not None and sent.memory_available_bytes > 0
    figures = sent.processes[0].measured
    assert figures is not None and (figures.batch_size, figures.sample_bytes) == (32, 1 << 20)
    assert figures.peak_rss_bytes - figures.baseline_rss_bytes >= 0.9 * (64 + 16) * MIB, figures
    assert figures.baseline_rss_bytes < 64 * MIB and figures.num_samples > 5 and figures.duration_s >= 0.2
    assert memory.report(time.monotonic()) is None, "nothing new: the measurement went out once"


def test_without_a_writable_cgroup_the_watchdog_kills_past_the_limit_after_one_warning(tmp_path: Path) -> None:
    warnings: list[str] = []
    memory = RoleMemory("n0")
    memory.limiter = MemoryLimiter(force_watchdog=True, warn=warnings.append)
    reports = run_processes(tmp_path, memory, {1: (256, 160 * MIB, False), 2: (8, 160 * MIB, False)})
    assert reports[1].oom_killed and reports[1].overshoot_bytes > 0, reports[1]
    assert reports[1].describe().startswith("was OOM-killed at its memory limit")
    assert reports[2].exitcode == 0 and not reports[2].oom_killed, reports[2].log_tail
    assert len(warnings) == 1 and "RSS watchdog" in warnings[0], warnings


if sys.platform != "linux":
    pytest.skip("memory limits need Linux", allow_module_level=True)
