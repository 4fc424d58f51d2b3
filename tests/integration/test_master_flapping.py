"""A node whose agent keeps dying (and is relaunched) is excluded once over its regroup budget;
the job goes on with the others and the launcher stops relaunching it."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import psutil
import pytest
from helpers import ProcessScope, fixture, wait_for

pytestmark = pytest.mark.slow
EXCLUDED = r"node local1 caused \d+ regroups in 600 s \(at most 2 allowed\): excluded from the job"


def _agent_of_local1(launcher_pid: int, not_pid: int = -1) -> psutil.Process:
    def find() -> psutil.Process | None:
        for child in psutil.Process(launcher_pid).children():
            try:
                words = " ".join(child.cmdline())
            except psutil.Error:  # exited (a zombie until the launcher reaps it)
                continue
            if "agent" in words and "--node-id local1" in words and child.pid != not_pid:
                return child
        return None

    return wait_for(find, 30, "an agent of node local1")  # type: ignore[return-value]


def test_a_flapping_node_is_excluded_and_the_job_goes_on(procs: ProcessScope, run_dir: Path) -> None:
    job = procs.start(["run", "--nnodes", "1:2", "--relaunch", "--max-regroups", "2", "--regroup-window", "600",
                       "--preload", "", "--stop-grace", "1", "--run-dir", run_dir, fixture("worker.py"),
                       "--hold", 4])
    job.wait_output(r"round 1: 2 nodes")
    killed = -1
    for kills in range(1, 5):  # each kill is a loss and, once relaunched, usually a growth: two regroups
        agent = _agent_of_local1(job.pid, not_pid=killed)
        killed = agent.pid
        agent.send_signal(signal.SIGKILL)

        def back_or_excluded(kills: int = kills) -> bool:
            out = job.stdout()
            after_relaunch = out.split("relaunching it")
            return bool(re.search(EXCLUDED, out)) or (
                len(after_relaunch) > kills and re.search(r"round \d+: 2 nodes", after_relaunch[-1]) is not None)

        wait_for(back_or_excluded, 60, "node local1 back in the job, or excluded")
        if re.search(EXCLUDED, job.stdout()):
            break
    job.wait_output(EXCLUDED)
    job.wait_output(r"agent of node local1 exited with a usage error; not relaunching it", timeout=60)
    result = job.wait()
    assert result.returncode == 0, result.explain()
    assert "convoy: job succeeded: all 1 workers finished" in result.stdout
    assert "with 0 restart(s)" in result.stdout
