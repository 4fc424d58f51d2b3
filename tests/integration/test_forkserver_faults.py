"""A fork server that stops answering or dies, on real processes and real signals: a child of a SIGSTOPped server
is seen to end with its own exit (the server cannot report it), the server is then killed for not answering and
its other children die with it, each naming the fault; a dead server is reaped at once (no zombie until the job
ends), and the role processes of a stopped server are stopped within a bound."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import psutil
import pytest
from helpers import wait_for

from convoy.agent.forked import ForkedProcess, ForkServer
from convoy.agent.role_procs import JobContext, RoleProcesses
from convoy.config import WorkerConfig
from convoy.control.protocol import messages as p

pytestmark = pytest.mark.slow
if sys.platform != "linux":
    pytest.skip("the fork server needs Linux", allow_module_level=True)

ANSWER_S = 1.0


@pytest.fixture
def sleeper(tmp_path: Path) -> str:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(60)\n")
    return str(script)


@pytest.fixture
def server() -> ForkServer:
    forks = ForkServer.start(("json",), dict(os.environ), answer_s=ANSWER_S)
    forks.node_id = "n0"
    yield forks
    try:
        os.kill(forks.pid, signal.SIGCONT)  # a test that failed may leave it stopped
    except ProcessLookupError:
        pass
    forks.close()


def spawn(forks: ForkServer, script: str) -> ForkedProcess:
    process = forks.spawn(dict(os.environ), [script], script, False, [], 30, own_pages=False)
    assert process.stdout is not None
    assert process.stdout.readline() == b"sleeping\n", "it runs its script"
    return process


def reaped(pid: int) -> bool:
    """Gone from the process table: exited and waited for by its parent (a zombie still counts as there)."""
    return not psutil.pid_exists(pid)


def test_a_child_of_a_stopped_fork_server_ends_with_its_own_exit_and_the_server_is_killed_with_the_rest(
        server: ForkServer, sleeper: str) -> None:
    killed, running = spawn(server, sleeper), spawn(server, sleeper)
    os.kill(server.pid, signal.SIGSTOP)
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait(timeout=10) == -signal.SIGKILL, "its exit is read though its server cannot report it"
    assert killed.fault == "", "it died of its own, not of its server"
    fault = wait_for(server.check, 10, "the stopped server to be found out")
    assert fault == f"the fork server of node n0 did not answer in {ANSWER_S:.0f} s", fault
    assert running.wait(timeout=10) == -signal.SIGKILL, "killed with its server"
    assert running.fault == fault
    wait_for(lambda: reaped(server.pid), 10, "the killed server to be reaped")
    for process in (killed, running):
        process.stdout.close()


def test_a_dead_fork_server_is_reaped_at_once_and_its_children_name_it(server: ForkServer, sleeper: str) -> None:
    child = spawn(server, sleeper)
    os.kill(server.pid, signal.SIGKILL)
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert child.fault == "the fork server of node n0 died (SIGKILL)", child.fault
    assert server.check() == child.fault
    wait_for(lambda: reaped(server.pid), 10, "the dead server to be reaped while its agent goes on")
    child.stdout.close()


def test_an_older_incarnation_on_a_stopped_fork_server_is_stopped_within_a_bound_and_reported(
        server: ForkServer, sleeper: str, tmp_path: Path) -> None:
    context = JobContext("j-stopped", "n0", "127.0.0.1", tmp_path, "127.0.0.1:1")
    processes = RoleProcesses(WorkerConfig(entrypoint=sleeper, stop_grace_s=1), context, forks=server)
    first = p.RoleAssignment(role="worker", rank=0, incarnation=0, world_size=1)
    processes.carry_out([first], [])
    log = tmp_path / "logs" / "roles" / "worker0.log"
    wait_for(lambda: log.exists() and "sleeping" in log.read_text(), 30, "incarnation 0 to run")
    os.kill(server.pid, signal.SIGSTOP)
    replies: list[p.RoleReport] = []
    second = p.RoleAssignment(role="worker", rank=0, incarnation=1, world_size=1)
    start = threading.Thread(target=lambda: replies.extend(processes.carry_out([second], [])), daemon=True)
    start.start()
    start.join(timeout=30)
    assert not start.is_alive(), "the start of incarnation 1 hangs on the stopped server"
    exits = [report for report in replies if report.state == "exited"]
    assert [(r.incarnation, r.signal) for r in exits] == [(0, "SIGTERM")], replies
    processes.stop_all()
