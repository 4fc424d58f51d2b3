"""Jobs of roles that hold, end to end on real processes (plain Python, no torch): a whole-job restart with a PS
ends, a role scaled down and at once up again has its old process reported, and a lost node's processes start
again on the other node without a role restart. The ``procs`` fixture checks that nothing outlives each test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import psutil
import pytest
from helpers import ProcessScope, fixture, node_of, wait_for

pytestmark = pytest.mark.slow

ROLE_SCRIPT = fixture("role_train.py")
BOUND_S = 60.0
"""Far above what these jobs need (seconds); a job still running then has hung."""


def run_args(run_dir: Path, *extra: object, roles: tuple = ()) -> list[str]:
    return ["run", *roles, "--preload", "", "--stop-grace", "1", "--run-dir", str(run_dir), ROLE_SCRIPT,
            *map(str, extra)]


def role_records(run_dir: Path) -> list[dict]:
    path = run_dir / "role_records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(run_dir: Path, kind: str) -> list[str]:
    lines = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [line["message"] for line in lines if line["kind"] == kind]


def test_a_whole_job_restart_of_a_job_with_a_ps_ends(procs: ProcessScope, run_dir: Path) -> None:
    """trainer is a custom role: its policy restarts the whole job; the PS comes back on its node and port."""
    result = procs.run(run_args(run_dir, "--fail-once", 0, roles=("--ps", "1", "--role", "trainer=2")),
                       timeout=BOUND_S)
    assert result.returncode == 0, result.explain()
    assert "trainer 0 failed (exited with code 1); role trainer restarts the whole job" in result.stdout
    assert "convoy: every role process starts again" in result.stdout, result.explain()
    assert "with 1 restart(s)" in result.stdout, "the job's end counts the restart its role spent"
    exited = events(run_dir, "role_exited")
    for role, rank in (("ps", 0), ("trainer", 1)):
        assert sum(f"{role} {rank} (incarnation" in line for line in exited) == 2, \
            f"{role} {rank}'s old and new processes each reported their exit once: {exited}"
    first, again = [r for r in role_records(run_dir) if r["role"] == "ps"]
    assert again["port"] == first["port"] and again["incarnation"] > first["incarnation"]


def test_a_role_scaled_down_then_up_at_once_reports_its_old_process_and_ends(procs: ProcessScope, run_dir: Path,
                                                                           tmp_path: Path) -> None:
    release = tmp_path / "release"
    job = procs.start(run_args(run_dir, "--hold-until", release, roles=("--ps", "1", "--workers", "1:3")))
    wait_for(lambda: any(r["role"] == "worker" for r in role_records(run_dir)), 30, "worker 0 to start")
    assert procs.run(["scale", "--run-dir", run_dir, "worker=3"]).returncode == 0
    wait_for(lambda: ("worker", 2) in {(r["role"], r["rank"]) for r in role_records(run_dir)}, 30,
             "worker 2 to start")
    for count in (2, 3):
        scaled = procs.run(["scale", "--run-dir", run_dir, f"worker={count}"])
        assert scaled.returncode == 0, scaled.explain()
    wait_for(lambda: [r["rank"] for r in role_records(run_dir) if r["role"] == "worker"].count(2) == 2, 30,
             "worker 2's new incarnation to start")
    release.touch()
    result = job.wait(BOUND_S)
    assert result.returncode == 0, result.explain()
    old, new = [r for r in role_records(run_dir) if (r["role"], r["rank"]) == ("worker", 2)]
    exited = events(run_dir, "role_exited")
    assert any(f"worker 2 (incarnation {old['incarnation']})" in line for line in exited), \
        f"the old worker 2, stopped to make room for the new one, is reported: {exited}"
    assert any(f"worker 2 (incarnation {new['incarnation']}) exited with code 0" in line for line in exited)


def test_a_lost_node_of_eight_workers_spends_no_restart(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    """8 workers over 2 nodes and the default --max-restarts 3: the lost node's 4 workers start again on the
    other node; no role restart is spent, the loss is one regroup."""
    release = tmp_path / "release"
    job = procs.start(run_args(run_dir, "--hold-until", release,
                               roles=("--nnodes", "1:2", "--rdzv-wait", "1", "--ps", "1", "--workers", "8")))
    wait_for(lambda: len(role_records(run_dir)) == 9, 30, "the PS and the 8 workers to start")
    assert all(psutil.pid_exists(r["pid"]) for r in role_records(run_dir)), job.stdout()
    ps_node = node_of(next(r["pid"] for r in role_records(run_dir) if r["role"] == "ps"))
    agents = {(command := agent.cmdline())[command.index("--node-id") + 1]: agent
              for agent in psutil.process_iter(["cmdline"])
              if "agent" in (agent.info["cmdline"] or []) and str(run_dir) in " ".join(agent.info["cmdline"] or [])}
    lost_node = next(node for node in agents if node != ps_node)
    lost = sorted(r["rank"] for r in role_records(run_dir) if node_of(r["pid"]) == lost_node)
    assert len(lost) >= 4, lost
    agents[lost_node].kill()
    wait_for(lambda: len(role_records(run_dir)) == 9 + len(lost), 30, "the lost node's workers to start again")
    moved = role_records(run_dir)[9:]
    assert sorted(r["rank"] for r in moved) == lost and {node_of(r["pid"]) for r in moved} == {ps_node}
    release.touch()
    result = job.wait(BOUND_S)
    assert result.returncode == 0, result.explain()
    assert "convoy: job succeeded: every role finished (ps x1, worker x8)" in result.stdout, result.explain()
    assert f"node {lost_node} was lost: its role processes ({', '.join(f'worker {r}' for r in lost)}) start again" \
        in result.stdout, result.explain()
    assert "restarting only it" not in result.stdout and "has used its" not in result.stdout, result.explain()
    assert "with 0 restart(s)" in result.stdout, result.explain()
    assert re.search(r"convoy: round 2: 1 nodes, .*; 1 of them placed without a join", result.stdout), \
        "the node that stays is in the next round at once (a job of roles: Rendezvous.carry_all)"


@pytest.mark.parametrize("preload", ["", "json"], ids=["own_process", "forked"])
def test_a_role_process_of_a_stopped_agent_stops_itself_and_is_placed_again(procs: ProcessScope, run_dir: Path,
                                                                           tmp_path: Path, preload: str) -> None:
    """Its agent SIGSTOPped past the heartbeat timeout, a role process's lease expires: it stops itself (one line)
    while the agent is still stopped, and the master starts its rank again on the other node (no role restart)."""
    release = tmp_path / "release"
    job = procs.start(["run", "--nnodes", "1:2", "--rdzv-wait", "1", "--ps", "1", "--workers", "2", "--preload",
                       preload, "--stop-grace", "1", "--heartbeat-timeout", "4", "--run-dir", run_dir, ROLE_SCRIPT,
                       "--hold-until", release])
    wait_for(lambda: len(role_records(run_dir)) == 3, 30, "the PS and both workers to start")
    ps_node = node_of(next(r["pid"] for r in role_records(run_dir) if r["role"] == "ps"))
    worker = next(r for r in role_records(run_dir) if r["role"] == "worker" and node_of(r["pid"]) != ps_node)
    stale_node = node_of(worker["pid"])
    agent = next(a for a in psutil.process_iter(["cmdline"]) if "agent" in (a.info["cmdline"] or [])
                 and stale_node in (a.info["cmdline"] or []) and str(run_dir) in " ".join(a.info["cmdline"]))
    agent.suspend()
    try:
        wait_for(lambda: not psutil.pid_exists(worker["pid"]) or psutil.Process(worker["pid"]).status() == "zombie",
                 20, "the stopped agent's worker to stop itself")
        assert agent.status() == "stopped", "it stopped itself: its agent was still stopped"
        wait_for(lambda: len(role_records(run_dir)) == 4, 30, "its rank to start again on the other node")
    finally:
        agent.resume()
    again = role_records(run_dir)[3]
    assert (again["role"], again["rank"]) == ("worker", worker["rank"]) and again["incarnation"] > worker["incarnation"]
    release.touch()
    result = job.wait(BOUND_S)
    assert result.returncode == 0, result.explain()
    log = (run_dir / "logs" / "roles" / f"worker{worker['rank']}.log").read_text()
    said = [line for line in log.splitlines() if "lease expired" in line]
    assert len(said) == 1 and said[0].startswith("convoy: the job's lease expired") and \
        f"stopping process {worker['pid']} now (exit code 75)" in said[0], log[-2000:]
    assert "has used its" not in result.stdout and "restarting only it" not in result.stdout, result.explain()
