"""Role processes forked from the agent's fork server, on real processes (plain Python, no torch): they come from
the server, their output reaches the log and the console with their prefix, their exit codes and signals reach
the reports, a memory limit counts what the server preloaded for them (heavy_preload.py: 96 MiB), and the
measurement samples them as it would a process that imported that itself; a whole job of roles forks every
process, restarts included, and leaves nothing behind."""

from __future__ import annotations

import io
import json
import os
import select
import sys
import time
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture, gone

from convoy.agent.forked import ForkServer, launch_server, server_env
from convoy.agent.inherited import own_inherited_pages
from convoy.agent.memory_limits import WATCHDOG, MemoryLimiter
from convoy.agent.role_memory import RoleMemory
from convoy.agent.role_procs import JobContext, RoleProcesses
from convoy.config import WorkerConfig
from convoy.control.protocol import messages as p
from convoy.errors import ConfigError

pytestmark = pytest.mark.slow

PROBE = fixture("forked_probe.py")
FIXTURES = str(Path(PROBE).parent)
MIB = 1024 * 1024
PRELOADED_MIB = 96


def probe_records(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "probe_records.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {entry["rank"]: entry for entry in map(json.loads, lines)}


def assignment(rank: int, *args: str, limit: int = 0, measure: bool = False) -> p.RoleAssignment:
    return p.RoleAssignment(role="worker", rank=rank, incarnation=rank, world_size=4, args=list(args),
                            memory_limit_bytes=limit, measure=measure)


@pytest.fixture
def server() -> ForkServer:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([FIXTURES, os.environ.get("PYTHONPATH", "")])}
    forks = ForkServer.start(("heavy_preload",), env)
    yield forks
    forks.close()
    assert forks.proc.returncode == 0


def run_until_reported(processes: RoleProcesses, count: int, stop_rank: int | None = None) -> dict[int, p.RoleReport]:
    reports: dict[int, p.RoleReport] = {}
    deadline = time.monotonic() + 30
    try:
        while len(reports) < count:
            assert time.monotonic() < deadline, f"only {sorted(reports)} ended"
            for process, report in processes.poll():
                reports[process.assignment.rank] = report
            if stop_rank is not None and (log := processes.context.run_dir / "logs" / "roles" /
                                          f"worker{stop_rank}.log").exists() and "running" in log.read_text():
                processes.stop(p.RoleStop(role="worker", rank=stop_rank, incarnation=stop_rank))
                stop_rank = None
            time.sleep(0.01)
    finally:
        processes.stop_all()
    return reports


@pytest.mark.parametrize("watchdog", [False, True], ids=["cgroup-or-watchdog", "watchdog"])
def test_forked_processes_report_exits_log_with_their_prefix_and_count_the_preloaded_memory(
        tmp_path: Path, server: ForkServer, watchdog: bool) -> None:
    console = io.BytesIO()
    memory = RoleMemory("n0")
    memory.limiter = MemoryLimiter(force_watchdog=watchdog, warn=lambda message: None)
    context = JobContext("j-forked", "n0", "127.0.0.1", tmp_path, "127.0.0.1:1")
    processes = RoleProcesses(WorkerConfig(entrypoint=PROBE, stop_grace_s=1), context, console=console,
                              memory=memory, forks=server)
    processes.start(assignment(0, "exit", "3"))
    processes.start(assignment(1, "exit", "0", limit=(PRELOADED_MIB + 160) * MIB))
    processes.start(assignment(2, "exit", "0", limit=(PRELOADED_MIB // 2) * MIB))  # below what it inherits
    processes.start(assignment(3, "sleep"))
    reports = run_until_reported(processes, 4, stop_rank=3)
    records = probe_records(tmp_path)
    assert reports[0].exitcode == 3 and reports[0].signal is None, reports[0]
    assert reports[1].exitcode == 0 and not reports[1].oom_killed, reports[1].log_tail
    assert reports[2].oom_killed, f"a limit below the preloaded {PRELOADED_MIB} MiB must stop it: {reports[2]}"
    assert reports[3].signal == "SIGTERM", reports[3]
    for rank in (0, 1, 3):
        assert records[rank]["ppid"] == server.pid and "convoy.agent.forkserver" in records[rank]["parent"]
        assert records[rank]["preloaded"], "the script ran in a process that had the preload list imported"
        assert gone(records[rank]["pid"])
        log = (tmp_path / "logs" / "roles" / f"worker{rank}.log").read_text()
        assert f"probe {rank} running" in log
        assert f"[worker{rank}]: probe {rank} running".encode() in console.getvalue()
    if memory.limiter.mechanism != WATCHDOG:  # the watchdog acts a few ms late
        assert "probe 2 running" not in console.getvalue().decode(), "over its limit, it never ran its script"
    assert reports[1].memory_peak_bytes >= PRELOADED_MIB * MIB, "its RSS counts the preloaded memory"


def test_a_forked_process_is_measured_as_one_that_imported_its_preload_itself(tmp_path: Path,
                                                                             server: ForkServer) -> None:
    memory = RoleMemory("n0")
    context = JobContext("j-forked", "n0", "127.0.0.1", tmp_path, "127.0.0.1:1")
    processes = RoleProcesses(WorkerConfig(entrypoint=PROBE, stop_grace_s=1), context, memory=memory, forks=server)
    processes.start(assignment(0, "measure", measure=True))
    reports = run_until_reported(processes, 1)
    assert reports[0].exitcode == 0, reports[0].log_tail
    sent = memory.report(time.monotonic())
    figures = sent.processes[0].measured if sent is not None else None
    assert figures is not None, "the measurement reached the report"
    # USS counts only the process's own pages: the preloaded memory is its own, as after its own import
    assert figures.baseline_uss_bytes >= PRELOADED_MIB * MIB, figures
    assert figures.peak_rss_bytes - figures.baseline_rss_bytes >= 24 * MIB, figures  # its 32 MiB batch


@pytest.mark.parametrize("job_omp", [None, "3"], ids=["default", "job-sets-it"])
def test_a_forked_role_process_runs_the_threads_its_role_declares(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  job_omp: str | None) -> None:
    """torch's OpenMP runtime took the server's thread count at import; each child takes its own: its role's
    cpus, else the job's OMP_NUM_THREADS, else 1 (as torchrun for several workers a node). Their waiting threads
    sleep (OMP_WAIT_POLICY, which the runtime read from the server's environment), unless the job says otherwise."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    if job_omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", job_omp)
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    forks = ForkServer.start(("torch",), server_env("127.0.0.1", "j-threads", "n0"))
    try:
        context = JobContext("j-threads", "n0", "127.0.0.1", tmp_path, "127.0.0.1:1")
        processes = RoleProcesses(WorkerConfig(entrypoint=PROBE, stop_grace_s=1), context, forks=forks)
        processes.start(assignment(0, "threads"))
        declared = assignment(1, "threads")
        declared.threads = 2
        processes.start(declared)
        reports = run_until_reported(processes, 2)
    finally:
        forks.close()
    logs = {rank: (tmp_path / "logs" / "roles" / f"worker{rank}.log").read_text() for rank in (0, 1)}
    assert all(reports[rank].exitcode == 0 for rank in (0, 1)), logs
    wait = "ACTIVE" if job_omp else "PASSIVE"
    assert f"threads {job_omp or 1} omp {job_omp or 1} wait {wait}" in logs[0], logs[0]
    assert f"threads 2 omp 2 wait {wait}" in logs[1], logs[1]


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "started"])
def test_only_a_measured_or_limited_role_process_hands_large_blocks_back_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forked: bool) -> None:
    """STEADY_MALLOC keeps a measured (or limited) process's memory flat, at the cost of mapping each large block
    afresh; the other role processes keep glibc's own threshold, forked from a server or started on their own."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)  # a value in the job's environment would win
    forks = ForkServer.start(("torch",), dict(os.environ)) if forked else None
    try:
        context = JobContext("j-malloc", "n0", "127.0.0.1", tmp_path, "127.0.0.1:1")
        processes = RoleProcesses(WorkerConfig(entrypoint=PROBE, stop_grace_s=1), context, forks=forks)
        processes.start(assignment(0, "malloc"))
        processes.start(assignment(1, "malloc", measure=True))
        reports = run_until_reported(processes, 2)
    finally:
        if forks is not None:
            forks.close()
    logs = {rank: (tmp_path / "logs" / "roles" / f"worker{rank}.log").read_text() for rank in (0, 1)}
    assert all(reports[rank].exitcode == 0 for rank in (0, 1)), logs
    assert "malloc heap" in logs[0], logs[0]
    assert "malloc mapped" in logs[1], logs[1]


def test_a_forked_child_owns_the_pages_it_shared_with_its_parent() -> None:
    held = bytearray(b"\x01") * (32 << 20)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write_end, str(own_inherited_pages()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    owned = int(os.read(read_end, 64) or b"0")
    os.waitpid(pid, 0)
    os.close(read_end)
    assert owned >= 32 << 20, "every present page it shared is its own now"
    assert len(held) == 32 << 20


def test_a_job_of_roles_forks_every_process_and_its_restarts(procs: ProcessScope, run_dir: Path) -> None:
    role_script = fixture("role_train.py")
    result = procs.run(["run", "--ps", "1", "--workers", "2", "--preload", "json", "--stop-grace", "1",
                        "--run-dir", str(run_dir), role_script, "--fail-once", "1"])
    assert result.returncode == 0, result.explain()
    assert "convoy: worker 1 failed (exited with code 1); restarting only it" in result.stdout, result.explain()
    records = [json.loads(line) for line in (run_dir / "role_records.jsonl").read_text().splitlines()]
    parents = [record["parent"] for record in records]
    assert len(parents) == 4, parents  # ps 0, workers 0 and 1, and worker 1 again
    assert all("convoy.agent.forkserver" in parent for parent in parents), parents
    launchers = {record["grandparent"] for record in records}  # started before the master and the agent
    assert len(launchers) == 1 and " run " in launchers.pop() and "agent" not in records[0]["grandparent"], records
    assert procs.wait_no_leftovers() == []


if sys.platform != "linux":
    pytest.skip("the fork server needs Linux", allow_module_level=True)


@pytest.mark.parametrize("handle", ["7", "x:1", "99999:1"])
def test_a_bad_fork_server_handle_is_refused_naming_the_flag(handle: str) -> None:
    with pytest.raises(ConfigError, match="--fork-server"):
        ForkServer.adopt(handle, "j")


def test_a_fork_server_whose_agent_is_gone_ends_quietly(tmp_path: Path) -> None:
    """An agent that dies with the server's messages unread resets the socket (ECONNRESET, not an end of file):
    the server ends with exit 0 and nothing on stderr, as at a clean close."""
    saved = os.dup(2)
    with open(tmp_path / "stderr", "wb") as err:
        os.dup2(err.fileno(), 2)  # the server inherits this process's stderr
        try:
            proc, ours = launch_server(("json",), dict(os.environ), die_with_us=False)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    deadline = time.monotonic() + 30
    while not select.select([ours], [], [], 0.05)[0]:  # its "ready" message waits unread in our end
        assert time.monotonic() < deadline, "the fork server never said it was ready"
    ours.close()
    assert proc.wait(30) == 0
    assert (tmp_path / "stderr").read_text() == ""
