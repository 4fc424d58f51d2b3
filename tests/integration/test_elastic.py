"""`convoy run` survives a killed master (no restart) and a killed agent (shrink, relaunch, grow)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import psutil
import pytest

from helpers import REPO, ProcessScope, fixture, wait_for

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "train_ddp.py")


def _child(launcher_pid: int, *words: str) -> psutil.Process:
    """The launcher's child process whose command line holds all ``words``."""
    def find() -> psutil.Process | None:
        for child in psutil.Process(launcher_pid).children():
            if all(word in " ".join(child.cmdline()) for word in words):
                return child
        return None

    return wait_for(find, 30, f"a child running {' '.join(words)}")  # type: ignore[return-value]


def test_killed_master_is_restarted_and_workers_train_through(procs: ProcessScope, run_dir: Path) -> None:
    job = procs.start(["run", "--nnodes", 2, "--preload", "", "--run-dir", run_dir, fixture("worker.py"),
                       "--hold", 6])
    job.wait_output(r"round 1: 2 nodes")
    _child(job.pid, "convoy", "master").send_signal(signal.SIGKILL)
    job.wait_output(r"master killed by SIGKILL; restarting it from the run dir")
    job.wait_output(r"master resumed in round 1")
    result = job.wait()
    assert result.returncode == 0, result.explain()
    assert "with 0 restart(s)" in result.stdout, result.explain()
    assert not (run_dir / "logs" / "round2").exists(), "the workers must not have been restarted"


def test_killed_agent_shrinks_then_grows_back_without_losing_steps(procs: ProcessScope, run_dir: Path) -> None:
    job = procs.start(["run", "--nnodes", "1:2", "--relaunch", "--run-dir", run_dir, "--stop-grace", 2,
                       EXAMPLE, "--steps", 100000, "--until", run_dir.parent / "end", "--step-time", 0.06,
                       "--persist-every", 0])
    job.wait_output(r"\[rank0\]: step 20 loss")
    _child(job.pid, "convoy", "agent", "local1").send_signal(signal.SIGKILL)
    job.wait_output(r"node local1 left \(agent killed by SIGKILL\): going on with 1 nodes")
    job.wait_output(r"agent of node local1 killed by SIGKILL; relaunching it")
    # the relaunched agent comes back either after the shrunk round formed (a growth), or while
    # the survivors are still stopping their workers, in which case round 2 already has both
    job.wait_output(r"node local1 joins: growing to 2 nodes|round 2: 2 nodes, world size 2", timeout=60)
    last_round = job.wait_output(r"starting at step (\d+) \(round [2-9], world size 2", timeout=60)
    (run_dir.parent / "end").touch()  # the job ends after its next step
    result = job.wait()
    assert result.returncode == 0, result.explain()
    out = result.stdout
    assert "restart(s)" in out and "with 0 restart(s)" in out, "membership changes are not restarts"
    assert re.search(r"round [2-9]: 2 nodes", out), "the relaunched node should be back in the job"
    finished = [int(step) for step in re.findall(r"\[rank0\]: step (\d+) loss", out)]
    resumes = [(m.start(), int(m.group(1))) for m in re.finditer(r"starting at step (\d+) \(round [2-9]", out)]
    assert resumes, out  # round 2 may be cut short by the growth before its workers print
    for position, start in resumes:
        printed_before = [int(s) for s in re.findall(r"\[rank0\]: step (\d+) loss", out[:position])]
        # on a failure: the job's own lines and the run's events (the step lines are many and alike)
        story = "\n".join(line for line in out.splitlines() if "loss" not in line)
        events = (run_dir / "events.jsonl").read_text() if (run_dir / "events.jsonl").exists() else ""
        assert start > max(printed_before), (f"resumed at {start} but step {max(printed_before)} had finished\n"
                                             f"{story}\n{events}")
    assert finished[-1] >= int(last_round.group(1))
