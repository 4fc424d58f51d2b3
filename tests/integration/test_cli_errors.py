"""User mistakes on the real command line: exit code 2, one clear line on stderr, nothing left running."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Iterator

import pytest
from helpers import ProcessScope, fixture, one_error_line

from convoy.config import MasterConfig, RendezvousConfig
from convoy.control.master import JobMaster
from convoy.control.store import read_status

pytestmark = pytest.mark.slow

WORKER = fixture("worker.py")
QUICK = ["--preload", "", "--stop-grace", "1"]


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    return {"run_dir": str(tmp_path / "run"), "file": str(a_file), "script": WORKER,
            "missing": str(tmp_path / "missing.py"), "tmp": str(tmp_path)}


@pytest.mark.parametrize(("args", "expected"), [
    (["run", *QUICK, "--run-dir", "{run_dir}", "{missing}"], "script '{missing}' not found"),
    (["run", *QUICK, "--run-dir", "{run_dir}"], "no training script given"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "--nnodes", "0", "{script}"], "--nnodes '0'"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "--nnodes", "3:1", "{script}"], "--nnodes '3:1'"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "--nnodes", "x", "{script}"], "--nnodes 'x'"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "--nproc-per-node", "0", "{script}"], "--nproc-per-node 0"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "--max-restarts", "-1", "{script}"], "--max-restarts -1"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "--port", "70000", "{script}"], "--port 70000"),
    (["run", *QUICK, "--run-dir", "{file}", "{script}"], "run dir '{file}'"),
    (["run", *QUICK, "--run-dir", "{file}/below", "{script}"], "run dir '{file}/below'"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "-m", "nonexistent_module_xyz"],
     "module 'nonexistent_module_xyz' not found"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "{tmp}"], "directory without __main__.py"),
    (["master", "--run-dir", "{run_dir}", "--nnodes", "2:1"], "--nnodes '2:1'"),
    (["master", "--run-dir", "{file}"], "run dir '{file}'"),
    (["agent", "--master", "127.0.0.1:9", "--token-file", "{tmp}/no-token", *QUICK, "{script}"],
     "--token-file '{tmp}/no-token' cannot be read: No such file or directory"),
    (["agent", "--master", "127.0.0.1:9", "--token-file", "{tmp}", *QUICK, "{script}"],
     "--token-file '{tmp}' cannot be read: Is a directory"),
    (["agent", "--master", "nohost", "--token-file", "{file}", *QUICK, "{script}"],
     "--master 'nohost' is not HOST:PORT"),
    (["agent", "--master", "127.0.0.1:9", "--token-file", "{file}", *QUICK, "{missing}"],
     "script '{missing}' not found"),
    (["agent", "--master", "127.0.0.1:9", "--token-file", "{file}", *QUICK, "--nproc-per-node", "0", "{script}"],
     "--nproc-per-node 0"),
    (["status", "--run-dir", "{tmp}"], "no convoy job state in '{tmp}'"),
    # issue 25, item 6: refused at once, not retried for 30 s as if the master were down
    (["agent", "--master", "http://10.0.0.5:29400", "--token-file", "{file}", *QUICK, "{script}"],
     "--master 'http://10.0.0.5:29400' is not HOST:PORT"),
    (["agent", "--master", "nosuchhost.invalid:29400", "--token-file", "{file}", *QUICK, "{script}"],
     "cannot resolve 'nosuchhost.invalid'"),
    (["agent", "--master", "127.0.0.1:9", "--token-file", "{file}", "--node-id", "n1\nconvoy: job succeeded", *QUICK,
      "{script}"], "--node-id 'n1\\nconvoy: job succeeded'"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "--heartbeat-timeout", "nan", "{script}"], "--heartbeat-timeout nan"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "--rdzv-wait", "nan", "{script}"], "--rdzv-wait nan"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "--join-timeout", "inf", "{script}"], "--join-timeout inf"),
    (["run", "--preload", "", "--stop-grace", "nan", "--run-dir", "{run_dir}", "{script}"], "--stop-grace nan"),
    (["run", *QUICK, "--run-dir", "{run_dir}", "--nproc-per-node", "1000000000", "{script}"], "need 1 to 1024"),
    (["master", "--run-dir", "{run_dir}", "--tls-cert", "{file}"], "--tls-cert and --tls-key together"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_bad_input_is_one_line_and_exit_code_2(procs: ProcessScope, paths: dict[str, str], args: list[str],
                                               expected: str) -> None:
    result = procs.run([arg.format(**paths) for arg in args], timeout=60)
    line = one_error_line(result)
    assert expected.format(**paths) in line, result.explain()
    assert result.stdout == "", "a refused command starts nothing, so prints nothing"
    assert procs.wait_no_leftovers(timeout=5) == []


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_master_port_in_use(procs: ProcessScope, run_dir: Path, busy_port: int) -> None:
    result = procs.run(["master", "--host", "127.0.0.1", "--port", busy_port, "--nnodes", "2", "--run-dir", run_dir],
                       timeout=60)
    line = one_error_line(result)
    assert f"port {busy_port} on 127.0.0.1 is already in use" in line
    assert procs.wait_no_leftovers(timeout=5) == []


def test_master_refused_for_a_busy_port_can_be_started_again(procs: ProcessScope, run_dir: Path,
                                                             busy_port: int) -> None:
    """Fixing the port and running the same command again works: a refused start leaves no job behind."""
    args = ["master", "--host", "127.0.0.1", "--nnodes", "1", "--run-dir", run_dir]
    assert f"port {busy_port} on 127.0.0.1 is already in use" in one_error_line(
        procs.run([*args, "--port", busy_port], timeout=60))
    master = procs.start([*args, "--port", "0"])
    try:
        master.wait_output(r"convoy: master of job \w+ at 127\.0\.0\.1:\d+", timeout=60)
    finally:
        if master.proc.poll() is None:
            os.kill(master.pid, signal.SIGINT)
            master.wait(timeout=30)


def test_run_serves_the_master_on_the_given_port(procs: ProcessScope, run_dir: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = procs.run(["run", *QUICK, "--port", port, "--run-dir", run_dir, WORKER], timeout=60)
    assert result.returncode == 0, result.explain()
    assert read_status(run_dir)["job"]["master_url"] == f"127.0.0.1:{port}", "--port is honoured"


def test_run_with_a_busy_port_is_refused(procs: ProcessScope, run_dir: Path, busy_port: int) -> None:
    result = procs.run(["run", *QUICK, "--port", busy_port, "--run-dir", run_dir, WORKER], timeout=60)
    assert f"port {busy_port} on 127.0.0.1 is already in use" in one_error_line(result)
    assert procs.wait_no_leftovers(timeout=5) == []


def test_run_dir_of_an_earlier_job_is_refused(procs: ProcessScope, run_dir: Path) -> None:
    args = ["run", *QUICK, "--run-dir", run_dir, WORKER]
    first = procs.run(args, timeout=60)
    assert first.returncode == 0, first.explain()
    line = one_error_line(procs.run(args, timeout=60))
    assert f"run dir '{run_dir}' already holds a job's state" in line
    assert read_status(run_dir)["job"]["status"] == "succeeded", "the earlier job's record is untouched"


def test_agent_with_a_wrong_token_is_refused_and_recorded(procs: ProcessScope, tmp_path: Path) -> None:
    run_dir = tmp_path / "master-run"
    config = MasterConfig(host="127.0.0.1", port=0, run_dir=run_dir, rendezvous=RendezvousConfig(1, 1, 0.0, 60.0))
    config.validate()
    master = JobMaster(config, console=lambda line: None)
    master.start()
    try:
        wrong = tmp_path / "wrong-token"
        wrong.write_text("not-the-token\n")
        result = procs.run(["agent", "--master", master.url, "--token-file", wrong, "--run-dir", tmp_path / "agent-run",
                            *QUICK, WORKER], timeout=60)
        line = one_error_line(result)
        assert f"master at {master.url} rejected the token: check --token-file" in line
        assert master.job.rendezvous.joined == [] and master.job.status == "running"
        assert [e["kind"] for e in read_status(run_dir)["events"]][-1] == "unauthorized"
        assert procs.wait_no_leftovers(timeout=5) == [], "the agent's standby workers went with it"
    finally:
        master.stop()
