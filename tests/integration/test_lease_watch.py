"""A process whose round lease has expired stops itself with one line, wherever its main thread is: blocked in a
gloo collective (the real bootstrap a convoy worker runs its script with), or a ``--no-python`` program under
``convoy run`` whose agent was SIGSTOPped past the heartbeat timeout."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture, gone, wait_for

from convoy.ports import unclaimed_port
from convoy.worker.lease import LeaseWriter

pytestmark = pytest.mark.slow

BOOTSTRAP = "import sys; from convoy.agent.standby import run_script; sys.argv = sys.argv[1:]; " \
            "sys.exit(run_script(sys.argv[0], False))"
"""What a standby or a fork server's child does with its script (``standby.run_script``), from the command line."""


def test_a_worker_blocked_in_a_collective_stops_once_its_lease_expires(procs: ProcessScope, tmp_path: Path) -> None:
    lease = LeaseWriter(tmp_path / "lease")
    try:
        lease.grant(1, time.monotonic(), 600.0)
        ranks = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(unclaimed_port("127.0.0.1")), "WORLD_SIZE": "2",
                 "OMP_NUM_THREADS": "1"}
        peer = procs.start([fixture("lease_collective.py"), 120], command=[sys.executable],
                           env={**ranks, "RANK": "1"})  # no lease: it runs no watcher and is never stopped by one
        worker = procs.start([fixture("lease_collective.py"), 120], command=[sys.executable, "-c", BOOTSTRAP],
                             env={**ranks, "RANK": "0", "CONVOY_LEASE": str(lease.path), "CONVOY_ROUND": "1"})
        child = int(worker.wait_output(r"^child (\d+)$").group(1))
        worker.wait_output("^receiving$")
        peer.wait_output("^joined$")
        lease.grant(1, time.monotonic() - 600.0, 0.5)  # no more answers from the master: the term runs out
        result = worker.wait(60)
        assert result.returncode == 75, result.explain()
        assert "received" not in result.stdout
        said = [line for line in result.stderr.splitlines() if "lease expired" in line]
        assert len(said) == 1 and said[0].startswith("convoy: round 1's lease expired") and \
            said[0].endswith(f"stopping process {worker.pid} now (exit code 75)"), result.explain()
        wait_for(lambda: gone(child), 10, "the child the worker started in its process group to be stopped with it")
        assert not gone(peer.pid), "the process without a lease runs on"
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(30)
    finally:
        lease.close()


def test_a_no_python_worker_of_a_stopped_agent_is_stopped_by_its_watcher(procs: ProcessScope, tmp_path: Path) -> None:
    """``--no-python``: the worker becomes another program, so a forked child of its standby watches its lease."""
    run_dir = tmp_path / "run"
    program = 'if [ "$CONVOY_ROUND" = 1 ]; then echo "worker $$ agent $PPID"; while :; do sleep 0.05; done; fi'
    job = procs.start(["run", "--no-python", "--nproc-per-node", 1, "--heartbeat-timeout", 3, "--stop-grace", 1,
                       "--run-dir", run_dir, "sh", "-c", program])
    started = job.wait_output(r"^\[rank0\]: worker (\d+) agent (\d+)$", timeout=90)
    worker, agent = int(started.group(1)), int(started.group(2))
    os.kill(agent, signal.SIGSTOP)
    try:
        wait_for(lambda: gone(worker), 30, "the stopped agent's worker to be stopped by its watcher")
        job.wait_output(r"sent no heartbeat for 3 s", timeout=30)
    finally:
        os.kill(agent, signal.SIGCONT)
    result = job.wait(90)
    assert result.returncode == 0, result.explain()
    log = (run_dir / "logs" / "round1" / "rank0.log").read_text()
    said = [line for line in log.splitlines() if "lease expired" in line]
    assert len(said) == 1 and said[0].startswith("convoy: round 1's lease expired") and \
        said[0].endswith(f"stopping process {worker} now (SIGKILL)"), log
    assert procs.wait_no_leftovers(timeout=10) == []
