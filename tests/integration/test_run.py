"""`convoy run` end to end with real processes and plain-Python workers (--preload '', no torch).

Failures are injected by the fixture worker (tests/fixtures/worker.py) or by a real SIGKILL
from here; each test asserts what the job did and, through the ``procs`` fixture, that no
process of the test outlived it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from helpers import (
    CONSOLE_SCRIPT,
    CONVOY,
    FIXTURES,
    ProcessScope,
    Result,
    fixture,
    gone,
    read_pid,
    records,
    wait_for,
)

pytestmark = pytest.mark.slow

WORKER = fixture("worker.py")


def run_args(run_dir: Path, *script: object, nnodes: str = "2", nproc: int = 2, options: tuple = ()) -> list[str]:
    return ["run", "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--preload", "", "--stop-grace", "1",
            "--run-dir", str(run_dir), *map(str, options), *map(str, script)]


def assert_succeeded(result: Result, world_size: int, restarts: int) -> None:
    assert result.returncode == 0, result.explain()
    assert f"convoy: job succeeded: all {world_size} workers finished" in result.stdout, result.explain()
    assert re.search(rf"convoy: finished in [\d.]+ s with {restarts} restart\(s\)", result.stdout), result.explain()


def test_clean_job_two_nodes_two_workers(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    odd_args = ["two words", "ünïcode", "--flag=1"]
    result = procs.run(run_args(run_dir, WORKER, "--record", record_dir, *odd_args))
    assert_succeeded(result, world_size=4, restarts=0)
    assert "convoy: round 1: 2 nodes, world size 4 [node0=127.0.0.1x2, node1=127.0.0.1x2]" in result.stdout
    assert result.stderr == "", result.explain()

    seen = records(record_dir, round_id=1)
    assert sorted(seen) == [0, 1, 2, 3], "every rank ran once and found a consistent torchrun environment"
    envs = [seen[rank]["env"] for rank in range(4)]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"], e["CONVOY_JOB_ID"]) for e in envs} == {
        ("4", "127.0.0.1", envs[0]["MASTER_PORT"], envs[0]["CONVOY_JOB_ID"])}
    assert [(e["GROUP_RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    node_of_group = {e["GROUP_RANK"]: e["CONVOY_NODE_ID"] for e in envs}  # first-round order is join order
    assert len(node_of_group) == 2 and set(node_of_group.values()) == {"local0", "local1"}
    assert all(e["CONVOY_NODE_ID"] == node_of_group[e["GROUP_RANK"]] for e in envs)
    assert {e["CONVOY_ROUND"] for e in envs} == {"1"} and {e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"0"}
    assert {e["CONVOY_RUN_DIR"] for e in envs} == {str(run_dir)}
    assert seen[0]["argv"] == [WORKER, "--record", str(record_dir), *odd_args], "argv arrives as python would give it"
    assert len({r["pid"] for r in seen.values()}) == 4

    for rank in range(4):
        log = run_dir / "logs" / "round1" / f"rank{rank}.log"
        assert envs[rank]["CONVOY_LOG_FILE"] == str(log)
        text = log.read_text()
        assert text.startswith(f"worker rank {rank} round 1 attempt 0 pid"), "the log holds the worker's own lines"
        done = f"[rank{rank}]: worker rank {rank} round 1 attempt 0 done"
        assert done in result.stdout, "the console prefixes the rank"
    assert stat_mode(run_dir / "token") == 0o600


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_worker_that_kills_itself_is_restarted(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    # rank 3 (node 1, local rank 1) SIGKILLs itself in attempt 0; the others would run for a minute
    result = procs.run(run_args(run_dir, WORKER, "--record", record_dir, "--kill", "3:0:0.3", "--hold-first", 60))
    assert_succeeded(result, world_size=4, restarts=1)
    out = result.stdout
    failure = "convoy: rank 3 (node 1, local rank 1) was killed by SIGKILL in round 1"
    assert failure in out and "convoy: restart 1/3: opening round 2" in out
    assert "convoy: round 2: 2 nodes, world size 4" in out
    assert out.index(failure) < out.index("restart 1/3") < out.index("convoy: round 2:")

    for round_id in (1, 2):
        logs = sorted(p.name for p in (run_dir / "logs" / f"round{round_id}").iterdir())
        assert logs == ["rank0.log", "rank1.log", "rank2.log", "rank3.log"], f"round {round_id}"
    assert "sending myself SIGKILL" in (run_dir / "logs" / "round1" / "rank3.log").read_text()
    assert "attempt 1 done" in (run_dir / "logs" / "round2" / "rank3.log").read_text()

    second = records(record_dir, round_id=2)
    assert sorted(second) == [0, 1, 2, 3]
    assert {r["env"]["CONVOY_ROUND"] for r in second.values()} == {"2"}
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in second.values()} == {"1"}
    first = records(record_dir, round_id=1)
    assert {r: first[r]["env"]["CONVOY_NODE_ID"] for r in first} == {
        r: second[r]["env"]["CONVOY_NODE_ID"] for r in second}, "node ranks are sticky across rounds"
    for rank in (0, 1, 2):  # stopped by their agents when the round ended, long before their minute was up
        assert gone(first[rank]["pid"])


def test_worker_killed_from_outside_is_restarted(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    job = procs.start(run_args(run_dir, WORKER, "--record", record_dir, "--hold-first", 60))
    pid_files = [record_dir / f"rank{rank}.round1.pid" for rank in range(4)]
    wait_for(lambda: all(p.exists() for p in pid_files), 60, "all four workers to start")
    victim = read_pid(pid_files[1])
    parent = psutil.Process(victim).parent()
    assert parent is not None and "agent" in parent.cmdline(), "the pid is a worker its agent started"
    os.kill(victim, signal.SIGKILL)
    result = job.wait()
    assert_succeeded(result, world_size=4, restarts=1)
    assert "convoy: rank 1 (node 0, local rank 1) was killed by SIGKILL in round 1" in result.stdout
    assert "convoy: restart 1/3: opening round 2" in result.stdout
    assert sorted(records(record_dir, round_id=2)) == [0, 1, 2, 3]
    assert gone(victim)


def test_restarts_exhausted_fails_naming_rank_code_and_last_lines(procs: ProcessScope, run_dir: Path) -> None:
    result = procs.run(run_args(run_dir, WORKER, "--exit", "1:3", nproc=1, options=("--max-restarts", 1)))
    assert result.returncode == 1, result.explain()
    out = result.stdout
    assert "convoy: rank 1 (node 1, local rank 0) exited with code 3 in round 1" in out
    assert "convoy: restart 1/1: opening round 2" in out
    assert "convoy: job failed: rank 1 (node 1, local rank 0) exited with code 3; no restarts left (1 of 1 used)" in out
    log = run_dir / "logs" / "round2" / "rank1.log"
    assert f"  last lines of {log}:" in out
    tail = out[out.index(f"last lines of {log}:"):]
    assert "    rank 1 marker line one\n    rank 1 marker line two, exiting with 3" in tail
    assert "convoy: finished in" in out and "with 1 restart(s)" in out
    assert (run_dir / "logs" / "round1" / "rank1.log").exists()


def test_script_exception_is_reported_with_the_scripts_traceback(procs: ProcessScope, run_dir: Path) -> None:
    result = procs.run(run_args(run_dir, WORKER, "--raise", 0, nnodes="1", nproc=1, options=("--max-restarts", 0)))
    assert result.returncode == 1, result.explain()
    assert "convoy: job failed: rank 0 (node 0, local rank 0) exited with code 1; no restarts left" in result.stdout
    log = (run_dir / "logs" / "round1" / "rank0.log").read_text()
    assert "Traceback (most recent call last):" in log and "RuntimeError: injected failure in rank 0" in log
    assert f'File "{WORKER}"' in log
    assert "standby.py" not in log and "runpy" not in log, "the traceback starts at the script, as under python"
    assert "    RuntimeError: injected failure in rank 0" in result.stdout, "the tail reaches the console"


def test_status_after_a_job_shows_job_round_nodes_and_events(procs: ProcessScope, run_dir: Path) -> None:
    result = procs.run(run_args(run_dir, WORKER, "--kill", "1:0:0", nproc=1))
    assert_succeeded(result, world_size=2, restarts=1)
    job_id = re.search(r"convoy: job (\w+): 2 nodes x 1 workers", result.stdout).group(1)  # type: ignore[union-attr]
    status = procs.run(["status", "--run-dir", run_dir], timeout=30)
    assert status.returncode == 0, status.explain()
    lines = status.stdout.splitlines()
    assert re.fullmatch(rf"job {job_id}: succeeded, round 2, restarts 1/3, nodes 2:2, master 127\.0\.0\.1:\d+",
                        lines[0]), status.stdout
    assert "  job succeeded: all 2 workers finished" in lines
    assert any(re.fullmatch(r"round 2: world size 2, store 127\.0\.0\.1:\d+ \[node0=127\.0\.0\.1x1, "
                            r"node1=127\.0\.0\.1x1\]", line) for line in lines), status.stdout
    nodes = lines[lines.index("nodes:") + 1: lines.index("recent events:")]
    assert sorted(tuple(line.split()[:3]) for line in nodes) in (
        [("local0", "rank", "0"), ("local1", "rank", "1")], [("local0", "rank", "1"), ("local1", "rank", "0")])
    assert [line.split()[2] for line in nodes] == ["0", "1"], "nodes are listed by rank"
    events = " ".join(lines[lines.index("recent events:") + 1:])
    for kind in ("round_closed", "worker_failed", "restart", "job_succeeded"):
        assert kind in events, status.stdout
    assert "rank 1 (node 1, local rank 0) was killed by SIGKILL in round 1" in events
    assert "round 2: 2 nodes, world size 2" in events and "2 of them placed without a join" in events, \
        "both nodes offered a port for round 2 in their wait: it closed with the restart, without a join"


def test_children_a_worker_leaves_behind_are_stopped(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    result = procs.run(run_args(run_dir, WORKER, "--record", record_dir, "--grandchild", nnodes="1", nproc=1))
    assert_succeeded(result, world_size=1, restarts=0)
    child = read_pid(record_dir / "rank0.round1.child.pid")
    wait_for(lambda: gone(child), 10, f"the worker's `sleep 300` child (pid {child}) to be stopped")


@pytest.mark.parametrize("launcher", [
    "python -m convoy",
    "convoy console script",
])
def test_module_entrypoint_is_found_like_python_m(procs: ProcessScope, run_dir: Path, tmp_path: Path,
                                                  launcher: str) -> None:
    """`convoy run -m worker` from the directory holding worker.py runs it, as `python -m worker` would."""
    if launcher == "convoy console script" and not CONSOLE_SCRIPT.exists():
        pytest.skip("convoy is not installed as a console script")
    command = [str(CONSOLE_SCRIPT)] if launcher == "convoy console script" else None
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    args = run_args(run_dir, "-m", "worker", "--record", record_dir, nnodes="1", nproc=2)
    result = procs.start(args, cwd=FIXTURES, **({"command": command} if command else {})).wait()
    assert_succeeded(result, world_size=2, restarts=0)
    seen = records(record_dir, round_id=1)
    assert sorted(seen) == [0, 1]
    assert seen[0]["argv"][0] == str(FIXTURES / "worker.py"), "runpy sets argv[0] to the module's file"


def test_job_ends_when_every_agent_is_gone(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    """If all agents die (here: SIGKILL), the launcher notices, fails the job and returns."""
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    job = procs.start(run_args(run_dir, WORKER, "--record", record_dir, "--hold", 60, nnodes="1", nproc=1))
    wait_for(lambda: (record_dir / "rank0.round1.pid").exists(), 60, "the worker to start")
    worker = read_pid(record_dir / "rank0.round1.pid")
    agent = psutil.Process(worker).parent()
    assert agent is not None and "agent" in agent.cmdline()
    agent.kill()
    result = job.wait()
    assert result.returncode == 1, result.explain()
    assert "every agent exited before the job ended" in result.stdout
    wait_for(lambda: gone(worker), 10, "the dead agent's worker to die with it")


def test_relative_script_path_runs_from_the_launchers_directory(procs: ProcessScope, run_dir: Path,
                                                                tmp_path: Path) -> None:
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    result = procs.start(run_args(run_dir, "worker.py", "--record", record_dir, nnodes="1", nproc=1),
                         cwd=FIXTURES).wait()
    assert_succeeded(result, world_size=1, restarts=0)
    record = records(record_dir, round_id=1)[0]
    assert record["argv"][0] == "worker.py" and record["cwd"] == str(FIXTURES)


def test_status_into_a_closed_pipe_exits_without_a_traceback(procs: ProcessScope, run_dir: Path) -> None:
    from convoy.control.job import Event, Job
    from convoy.control.rendezvous import Rendezvous
    from convoy.control.store import Store

    run_dir.mkdir()
    store = Store(run_dir)
    store.save(Job("abc", Rendezvous(1, 1, 0.0, opened_at=0.0), 0, 1.0),
               [Event("note", f"event {i} " + "x" * 200) for i in range(20)], "127.0.0.1:1", [])
    store.close()
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (e.g. `head -1`) is already gone
    try:
        proc = subprocess.run([*CONVOY, "status", "--run-dir", str(run_dir)], stdout=write_end,
                              stderr=subprocess.PIPE, env=procs.env(), timeout=60, text=True)
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr, proc.stderr
