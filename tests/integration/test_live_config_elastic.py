"""The live training config in an elastic job, end to end: after a node is lost, the ranks that left no longer
hold back the ranks that run, so a change they ran for TRUST_STEPS steps is trusted and a later failure does not
revert it."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from pathlib import Path

import psutil
import pytest
from helpers import REPO, ProcessScope, wait_for

from convoy.control.store import read_status
from convoy.control.token import TOKEN_FILE
from convoy.control.training.master import TRUST_STEPS

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "train_live_config.py")


def rows(log_dir: Path, rank: int) -> list[tuple[int, float, int]]:
    """Rank ``rank``'s ``(step, lr, round)`` lines (the example's log)."""
    path = log_dir / f"rank{rank}.log"
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [(int(r[0]), float(r[1]), int(r[4])) for r in lines]


def master_step(run_dir: Path, task: str) -> int:
    """The newest step of ``task`` the master has (the steps reach it every FLUSH_S, after the rank's log)."""
    job = read_status(run_dir, recent=0)["job"]
    token = (run_dir / TOKEN_FILE).read_text().strip()
    request = urllib.request.Request(f"http://{job['master_url']}/v1/metrics?task={task}&limit=1",
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        latest = [row for row in json.loads(answer.read())["latest"] if row["task"] == task]
    return latest[0]["step"] if latest else -1


def agent(procs: ProcessScope, node_id: str) -> psutil.Process | None:
    """This test's agent of node ``node_id``."""
    for proc in procs.leftovers():
        try:
            command = proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "agent" in command and "--node-id" in command and command[command.index("--node-id") + 1] == node_id:
            return proc
    return None


def writer(procs: ProcessScope, log: Path) -> psutil.Process | None:
    """This test's process that holds ``log`` open: the rank that writes it (a worker started from a standby
    interpreter shows the standby's command line and environment)."""
    for proc in procs.leftovers():
        try:
            if any(opened.path == str(log) for opened in proc.open_files()):
                return proc
        except psutil.NoSuchProcess:
            continue
    return None


def test_a_change_the_ranks_left_after_a_lost_node_ran_long_enough_is_not_reverted(
        procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    job = procs.start(["run", "--nnodes", "1:2", "--preload", "", "--run-dir", run_dir, "--stop-grace", "2",
                       "--set", "steps=100000", EXAMPLE, "--step-time", "0.03", "--log-dir", logs])
    wait_for(lambda: len(rows(logs, 0)) > 5 and len(rows(logs, 1)) > 5 and master_step(run_dir, "default:1") >= 0,
             120, "both ranks to run 5 steps and report")
    wait_for(lambda: agent(procs, "local1"), 30, "node local1's agent").send_signal(signal.SIGKILL)
    job.wait_output(r"node local1 left \(agent killed by SIGKILL\): going on with 1 nodes")
    wait_for(lambda: any(r[2] == 2 for r in rows(logs, 0)), 120, "rank 0 to train in round 2, alone")

    output = procs.run(["config", "set", "lr=0.005", "--run-dir", run_dir]).output
    hot_step = int(re.search(r"applied in place from step (\d+)", output).group(1))
    wait_for(lambda: master_step(run_dir, "default:0") >= hot_step + TRUST_STEPS, 120,
             f"rank 0 to report {TRUST_STEPS} steps with the change")
    wait_for(lambda: writer(procs, logs / "rank0.log"), 30, "rank 0's process").send_signal(signal.SIGKILL)
    job.wait_output(r"restart 1/3: opening round 3")
    wait_for(lambda: any(r[2] == 3 for r in rows(logs, 0)), 120, "rank 0 to train in round 3")
    output = procs.run(["config", "set", f"steps={hot_step + TRUST_STEPS + 20}", "--run-dir", run_dir]).output
    assert "applied in place" in output, output
    result = job.wait()
    assert result.returncode == 0, result.explain()

    events = read_status(run_dir, recent=1000)["events"]
    assert not [e["message"] for e in events if e["kind"] == "config_reverted"], \
        "rank 1 left with node local1: its frozen step must not keep the change untrusted"
    history = json.loads(procs.run(["config", "history", "--json", "--run-dir", run_dir]).stdout)["versions"]
    changed = next(v for v in history if v["changed"] == {"lr": 0.005})
    assert changed["trusted"] and changed["status"] != "reverted", changed
    assert all(lr == 0.005 for step, lr, round_id in rows(logs, 0) if round_id == 3 and step >= hot_step), \
        "round 3 kept the change"
