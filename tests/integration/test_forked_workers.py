"""A node's workers are forked from its fork server, which the launcher starts before the master and the agent
(the agent takes it over): every round's (a restart's too) from the same server, with the environment a worker
started on its own would have; a killed fork server takes its workers with it, and the
job regroups on a fresh server, spending no restart; ``--preload ''`` keeps standbys from the start."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest
from helpers import REPO, ProcessScope, wait_for

pytestmark = pytest.mark.slow
WORKER = str(REPO / "tests" / "fixtures" / "worker.py")


def start(procs: ProcessScope, run_dir: Path, records: Path, preload: str, *extra: object):  # noqa: ANN201
    records.mkdir()
    return procs.start(["run", "--nnodes", 1, "--nproc-per-node", 2, "--preload", preload, "--stop-grace", 1,
                        "--run-dir", run_dir, WORKER, "--record", records, "--hold-first", 60, *extra])


def pids(records: Path, round_id: int) -> list[int]:
    files = [records / f"rank{rank}.round{round_id}.pid" for rank in range(2)]
    wait_for(lambda: all(f.exists() for f in files), 60, f"both workers of round {round_id}")
    return [int(f.read_text()) for f in files]


def parents(records: Path, round_id: int) -> list[tuple[int, str]]:
    """Each rank's parent in ``round_id`` (its pid and command line), as the worker recorded it."""
    pids(records, round_id)
    seen = [json.loads((records / f"rank{rank}.round{round_id}.json").read_text()) for rank in range(2)]
    return [(record["ppid"], record["parent"]) for record in seen]


def test_every_rounds_workers_are_forked_from_the_nodes_one_server(procs: ProcessScope, run_dir: Path,
                                                                      tmp_path: Path) -> None:
    records = tmp_path / "records"
    job = start(procs, run_dir, records, "json")
    first = pids(records, 1)
    servers = {psutil.Process(pid).ppid() for pid in first}
    assert len(servers) == 1, "both workers have one parent"
    server = psutil.Process(servers.pop())
    assert "convoy.agent.forkserver" in " ".join(server.cmdline())
    launcher = psutil.Process(server.ppid())
    assert launcher.pid == job.pid, "the launcher started the server, before the master and the agent"
    agent = next(child for child in launcher.children() if "agent" in child.cmdline())
    assert agent.create_time() >= server.create_time()
    handle = agent.cmdline()[agent.cmdline().index("--fork-server") + 1]
    assert handle.endswith(f":{server.pid}"), "the agent took the server over"
    assert all(os.getpgid(pid) == pid for pid in first), "each worker is its own process group"
    os.kill(first[1], signal.SIGKILL)
    assert {ppid for ppid, _ in parents(records, 2)} == {server.pid}, "the restart forks from the same server"
    result = job.wait(60)
    assert result.returncode == 0, result.explain()
    for round_id in (1, 2):
        for rank in range(2):
            seen = json.loads((records / f"rank{rank}.round{round_id}.json").read_text())
            assert seen["env"]["RANK"] == str(rank) and seen["env"]["CONVOY_ROUND"] == str(round_id)
            assert seen["env"]["LOCAL_WORLD_SIZE"] == "2", "the node's settings as a standby would have them"
            assert seen["argv"][0] == WORKER
    procs.wait_no_leftovers()


def test_a_killed_fork_server_takes_its_workers_and_the_job_regroups_on_a_fresh_one(procs: ProcessScope,
                                                                                      run_dir: Path,
                                                                                      tmp_path: Path) -> None:
    """One infrastructure fault: the workers that died with the server are reported as such, the node regroups
    without spending a restart, and round 2 forks from a fresh server (the dead one reaped at once)."""
    records = tmp_path / "records"
    job = start(procs, run_dir, records, "json")
    first = pids(records, 1)
    server = psutil.Process(psutil.Process(first[0]).ppid())
    server.kill()
    wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                             for pid in first), 10, "the server's workers to die with it")
    wait_for(lambda: not psutil.pid_exists(server.pid), 10, "the dead server to be reaped while the job runs")
    second = parents(records, 2)
    assert len({ppid for ppid, _ in second}) == 1 and second[0][0] != server.pid, second
    assert all("convoy.agent.forkserver" in parent for _, parent in second), "round 2 forks from a fresh server"
    result = job.wait(60)
    assert result.returncode == 0, result.explain()
    fault = "the fork server of node local0 died"
    assert f"{fault}; a fresh one takes its place" in result.stderr, result.explain()
    assert f"convoy: infrastructure fault: {fault}" in result.stdout, result.explain()
    assert "restart 1/" not in result.stdout, "the fault spent no restart: " + result.stdout
    procs.wait_no_leftovers()


def test_an_empty_preload_keeps_standbys(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    records = tmp_path / "records"
    job = start(procs, run_dir, records, "")
    first = pids(records, 1)
    assert all("convoy.agent.standby" in " ".join(psutil.Process(pid).cmdline()) for pid in first)
    assert all("convoy agent" in parent for _, parent in parents(records, 1))
    os.kill(first[0], signal.SIGKILL)
    assert job.wait(60).returncode == 0
