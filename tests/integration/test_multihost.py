"""Multi-host by hand, on loopback: `convoy master` plus two `convoy agent` processes."""

from __future__ import annotations

import json
import socket
import os
import signal
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture, one_error_line, wait_for

from convoy.control.store import read_status

pytestmark = pytest.mark.slow

WORKER = fixture("worker.py")


def test_master_and_two_agents_by_hand(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    master = procs.start(["master", "--host", "127.0.0.1", "--port", "0", "--nnodes", "2", "--run-dir", run_dir])
    match = master.wait_output(r"convoy: master of job (\w+) at 127\.0\.0\.1:(\d+); token file (\S+)$", timeout=60)
    job_id, port, token_file = match.group(1), int(match.group(2)), Path(match.group(3))
    assert token_file == run_dir / "token" and token_file.is_file()
    hint = master.wait_output(r"convoy: on each node: convoy agent --master HOST:(\d+) --token-file (\S+) ", timeout=5)
    assert int(hint.group(1)) == port and Path(hint.group(2)) == token_file

    # an agent holding the wrong token is turned away (and recorded) without disturbing the job
    wrong = tmp_path / "wrong-token"
    wrong.write_text("nope\n")
    refused = procs.run(["agent", "--master", f"127.0.0.1:{port}", "--token-file", wrong, "--preload", "", WORKER],
                        timeout=60)
    assert "rejected the token" in one_error_line(refused)

    record_dir = tmp_path / "records"
    record_dir.mkdir()
    agents = [
        procs.start(["agent", "--master", f"127.0.0.1:{port}", "--token-file", token_file, "--nproc-per-node", "1",
                     "--preload", "", "--stop-grace", "1", WORKER, "--record", record_dir])
        for _ in range(2)
    ]
    results = [agent.wait() for agent in agents]
    for result in results:
        assert result.returncode == 0, result.explain()
    master_result = master.wait(timeout=60)
    assert master_result.returncode == 0, master_result.explain()
    assert "convoy: round 1: 2 nodes, world size 2" in master_result.stdout
    assert "convoy: job succeeded: all 2 workers finished" in master_result.stdout

    envs = {}
    for path in record_dir.glob("rank*.round1.json"):
        env = json.loads(path.read_text())["env"]
        envs[int(env["RANK"])] = env
    assert sorted(envs) == [0, 1]
    assert {e["CONVOY_JOB_ID"] for e in envs.values()} == {job_id}
    assert {e["WORLD_SIZE"] for e in envs.values()} == {"2"} and {e["MASTER_ADDR"] for e in envs.values()} == {
        "127.0.0.1"}
    host = socket.gethostname()
    assert {e["CONVOY_NODE_ID"] for e in envs.values()} == {f"{host}-0", f"{host}-1"}, "default node id HOST-SLOT"
    assert {e["CONVOY_MASTER"] for e in envs.values()} == {f"127.0.0.1:{port}"}
    assert (run_dir / "logs" / "round1" / "rank0.log").exists() and (run_dir / "logs" / "round1" / "rank1.log").exists()
    # each agent printed its own worker's lines
    assert sorted("[rank0]:" in r.stdout for r in results) == [False, True]

    status = procs.run(["status", "--run-dir", run_dir], timeout=30)
    assert status.returncode == 0, status.explain()
    assert status.stdout.startswith(f"job {job_id}: succeeded, round 1, restarts 0/3, nodes 2:2")
    assert "unauthorized" in status.stdout, "the refused agent is on record"


def test_agent_fails_when_the_job_fails(procs: ProcessScope, run_dir: Path) -> None:
    master = procs.start(["master", "--host", "127.0.0.1", "--port", "0", "--nnodes", "1", "--max-restarts", "0",
                          "--run-dir", run_dir])
    port = int(master.wait_output(r"at 127\.0\.0\.1:(\d+);", timeout=60).group(1))
    agent = procs.run(["agent", "--master", f"127.0.0.1:{port}", "--token-file", run_dir / "token", "--preload", "",
                       "--stop-grace", "1", WORKER, "--exit", "0:5"])
    assert agent.returncode == 1, agent.explain()
    result = master.wait(timeout=60)
    assert result.returncode == 1, result.explain()
    expected = "job failed: rank 0 (node 0, local rank 0) exited with code 5; no restarts left (0 of 0 used)"
    assert expected in result.stdout, result.explain()


@pytest.mark.parametrize(("sig", "code"), [
    ("SIGINT", 130),
    ("SIGTERM", 143),
])
def test_stopping_the_master_stops_the_agents(procs: ProcessScope, run_dir: Path, tmp_path: Path, sig: str,
                                              code: int) -> None:
    """Ctrl-C or SIGTERM of `convoy master`: the job is recorded as failed and every agent hears it."""
    master = procs.start(["master", "--host", "127.0.0.1", "--port", "0", "--nnodes", "1", "--run-dir", run_dir])
    port = int(master.wait_output(r"at 127\.0\.0\.1:(\d+);", timeout=60).group(1))
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    agent = procs.start(["agent", "--master", f"127.0.0.1:{port}", "--token-file", run_dir / "token", "--preload", "",
                         "--stop-grace", "1", WORKER, "--record", record_dir, "--hold", 60])
    wait_for(lambda: (record_dir / "rank0.round1.pid").exists(), 60, "the worker to start")
    os.kill(master.pid, getattr(signal, sig))
    result = master.wait(timeout=30)
    try:
        assert result.returncode == code, result.explain()
        agent_result = agent.wait(timeout=30)
        assert agent_result.returncode == 1, agent_result.explain()
        job = read_status(run_dir)["job"]
        assert job["status"] == "failed" and f"interrupted by {sig}" in job["outcome"], job
        assert procs.wait_no_leftovers(timeout=5) == []
    finally:
        procs.kill_all()  # when this fails, the orphaned agent would otherwise run for its 30 s
