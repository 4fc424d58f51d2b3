"""Faults of a job started from torchrun's several-host line (two launchers on loopback at one endpoint): the
claimer's master, SIGKILLed, comes back on the same listening socket (the launcher holds it) and the joiner's
agent reconnects to it without a restart of the workers; the joiner's agent, SIGKILLed, is relaunched by its
launcher under the same node id and rejoins, and training resumes past every finished step."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import psutil
import pytest
from helpers import REPO, Launched, ProcessScope, fixture, wait_for

from convoy.ports import unclaimed_port

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "train_ddp.py")
TOKEN = "the-jobs-token"


def _child(launcher: Launched, command: str) -> psutil.Process:
    """The launcher's child running ``convoy COMMAND`` (``master``, ``agent``)."""
    def find() -> psutil.Process | None:
        for child in psutil.Process(launcher.pid).children():
            try:
                line = child.cmdline()
            except psutil.Error:  # exited: a zombie until the launcher reaps it
                continue
            if any(word == "convoy" and after == command for word, after in zip(line, line[1:])):
                return child
        return None

    return wait_for(find, 30, f"a child of {launcher.pid} running convoy {command}")  # type: ignore[return-value]


def _listens(proc: psutil.Process, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in proc.net_connections("tcp"))
    except psutil.Error:
        return False


def _line(port: int, *extra: object) -> list[object]:
    return ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-conf", f"token={TOKEN}", *extra]


def test_a_killed_master_comes_back_on_the_endpoints_socket_and_the_joiner_trains_through(
        procs: ProcessScope, tmp_path: Path) -> None:
    port = unclaimed_port()
    claimer = procs.start(["run", *_line(port), "--run-dir", tmp_path / "a", "--preload", "", fixture("worker.py"),
                           "--hold", 8])
    claimer.wait_output(r"this host claimed 127\.0\.0\.1:\d+ and serves the master there")
    joiner = procs.start(["run", *_line(port), "--run-dir", tmp_path / "b", "--preload", "", fixture("worker.py"),
                          "--hold", 8])
    claimer.wait_output(r"round 1: 2 nodes")
    master = _child(claimer, "master")
    assert _listens(master, port), "the master serves the endpoint's port"
    master.send_signal(signal.SIGKILL)
    claimer.wait_output(r"master killed by SIGKILL; restarting it from the run dir")
    claimer.wait_output(r"master resumed in round 1")
    again = _child(claimer, "master")
    assert again.pid != master.pid and _listens(again, port), "the new master listens on the same port"
    results = [claimer.wait(timeout=120), joiner.wait(timeout=120)]
    assert [r.returncode for r in results] == [0, 0], "\n".join(r.explain() for r in results)
    assert "with 0 restart(s)" in results[0].stdout, "the workers of round 1 trained through"
    assert "the job succeeded" in results[1].stdout
    assert not (tmp_path / "a" / "logs" / "round2").exists(), "no new round: the workers were not restarted"
    assert procs.wait_no_leftovers() == []


def test_a_joiners_killed_agent_is_relaunched_rejoins_and_loses_no_step(procs: ProcessScope, tmp_path: Path) -> None:
    port = unclaimed_port()
    script = [EXAMPLE, "--steps", 100000, "--until", tmp_path / "end", "--step-time", 0.05, "--persist-every", 0]
    claimer = procs.start(["run", *_line(port, "--max-restarts=3"), "--run-dir", tmp_path / "a", "--stop-grace", 2,
                           *script])
    claimer.wait_output(r"this host claimed 127\.0\.0\.1:\d+ and serves the master there")
    joiner = procs.start(["run", *_line(port, "--max-restarts=3"), "--relaunch", "--run-dir", tmp_path / "b",
                          "--stop-grace", 2, *script])
    wait_for(lambda: any("[rank0]: step 20 loss" in job.stdout() for job in (claimer, joiner)), 120,
             "rank 0 (on either node) past step 20")
    node = re.search(r"joining the master at 127\.0\.0\.1:\d+ as node (\S+)", joiner.stdout())
    assert node, joiner.stdout()
    agent = _child(joiner, "agent")
    agent.send_signal(signal.SIGKILL)
    joiner.wait_output(rf"agent of node {re.escape(node[1])} killed by SIGKILL; relaunching it")
    claimer.wait_output(r"round [2-9]: 2 nodes, world size 2", timeout=90)
    wait_for(lambda: any(re.search(r"starting at step \d+ \(round [2-9], world size 2", job.stdout())
                         for job in (claimer, joiner)), 90, "rank 0 to start in the round with both nodes again")
    (tmp_path / "end").touch()  # the job ends after its next step
    results = [claimer.wait(timeout=180), joiner.wait(timeout=180)]
    assert [r.returncode for r in results] == [0, 0], "\n".join(r.explain() for r in results)
    relaunched = _node_ids(results[0].stdout)
    assert node[1] in relaunched, f"the relaunched agent rejoined as {node[1]}: {relaunched}"
    out = next(r.stdout for r in results if "[rank0]: step" in r.stdout)  # rank 0's node, either launcher's
    finished = [int(step) for step in re.findall(r"\[rank0\]: step (\d+) loss", out)]
    resumes = [(m.start(), int(m.group(1))) for m in re.finditer(r"starting at step (\d+) \(round [2-9]", out)]
    assert resumes, out
    for position, start in resumes:
        printed_before = [int(s) for s in re.findall(r"\[rank0\]: step (\d+) loss", out[:position])]
        assert start > max(printed_before), f"resumed at {start}, but step {max(printed_before)} had finished"
    assert finished[-1] >= max(start for _, start in resumes)
    assert procs.wait_no_leftovers() == []


def _node_ids(out: str) -> set[str]:
    """The nodes the master's lines name as joining or leaving."""
    return set(re.findall(r"node ([\w.-]+) (?:joins|joined|left)", out))
