"""A job of roles end to end on real processes (plain Python, no torch): a PS that answers on its port and
workers that find it through convoy.role(); a worker that fails restarts alone on its rank; convoy scale adds a
worker to a running job. The ``procs`` fixture checks that nothing outlives each test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import psutil
import pytest
from helpers import ProcessScope, Result, fixture, node_of, wait_for

pytestmark = pytest.mark.slow

ROLE_SCRIPT = fixture("role_train.py")


def run_args(run_dir: Path, *extra: object, roles: tuple = ("--ps", "1", "--workers", "2")) -> list[str]:
    return ["run", *roles, "--preload", "", "--stop-grace", "1", "--run-dir", str(run_dir), ROLE_SCRIPT,
            *map(str, extra)]


def role_records(run_dir: Path) -> list[dict]:
    path = run_dir / "role_records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_succeeded(result: Result, counts: str) -> None:
    assert result.returncode == 0, result.explain()
    assert f"convoy: job succeeded: every role finished ({counts})" in result.stdout, result.explain()


def test_a_ps_and_two_workers_run_find_each_other_and_end_with_the_ps_stopped(procs: ProcessScope,
                                                                               run_dir: Path) -> None:
    result = procs.run(run_args(run_dir))
    assert_succeeded(result, "ps x1, worker x2")
    seen = role_records(run_dir)
    assert sorted((r["role"], r["rank"]) for r in seen) == [("ps", 0), ("worker", 0), ("worker", 1)]
    ps = next(r for r in seen if r["role"] == "ps")
    workers = [r for r in seen if r["role"] == "worker"]
    assert all(r["env_role"] == "worker" and r["world_size"] == 2 for r in workers), seen
    assert all(r["ps"] == [f"127.0.0.1:{ps['port']}"] for r in workers), "every worker got the PS's address"
    for rank in (0, 1):
        assert f"[worker{rank}]: worker{rank} of 2 did 3 steps with 1 ps" in result.stdout, result.explain()
        assert "did 3 steps" in (run_dir / "logs" / "roles" / f"worker{rank}.log").read_text()
    assert "ps0 stopping" in (run_dir / "logs" / "roles" / "ps0.log").read_text(), "the PS got SIGTERM at the end"
    assert result.stdout.index("[ps0]: ps0 stopping") < result.stdout.index("convoy: job succeeded"), \
        "the job ends once the PS has stopped"


def test_a_failed_worker_restarts_alone_on_its_rank(procs: ProcessScope, run_dir: Path) -> None:
    result = procs.run(run_args(run_dir, "--fail-once", 0))
    assert_succeeded(result, "ps x1, worker x2")
    assert "convoy: worker 0 failed (exited with code 1); restarting only it (restart 1 of 3 for role worker)" \
        in result.stdout, result.explain()
    seen = role_records(run_dir)
    by_process = sorted((r["role"], r["rank"]) for r in seen)
    assert by_process == [("ps", 0), ("worker", 0), ("worker", 0), ("worker", 1)], "only worker 0 started again"
    first, again = [r for r in seen if (r["role"], r["rank"]) == ("worker", 0)]
    assert first["pid"] != again["pid"] and again["incarnation"] > first["incarnation"]
    assert again["ps"] == first["ps"], "the restarted worker found the same PS"
    assert "convoy: restart" not in result.stdout, "no round of the whole job was opened"


def test_convoy_scale_adds_a_worker_to_a_running_job(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    release = tmp_path / "release"
    job = procs.start(run_args(run_dir, "--hold-until", release, roles=("--ps", "1", "--workers", "1:3")))
    wait_for(lambda: any(r["role"] == "worker" for r in role_records(run_dir)), 20, "worker 0 to start")
    too_many = procs.run(["scale", "--run-dir", run_dir, "worker=4"])
    assert too_many.returncode == 2 and "role worker can run 1..3 processes (its count is 1:3), not 4" \
        in too_many.stderr, too_many.explain()
    scaled = procs.run(["scale", "--run-dir", run_dir, "worker=2"])
    assert scaled.returncode == 0 and "role worker of job" in scaled.stdout, scaled.explain()
    wait_for(lambda: ("worker", 1) in {(r["role"], r["rank"]) for r in role_records(run_dir)}, 20,
             "worker 1 to start")
    release.touch()
    result = job.wait()
    assert_succeeded(result, "ps x1, worker x2")
    assert "convoy: role worker: 1 -> 2 process(es)" in result.stdout, result.explain()
    worker1 = next(r for r in role_records(run_dir) if (r["role"], r["rank"]) == ("worker", 1))
    assert worker1["world_size"] == 2 and worker1["ps"], worker1


def test_the_processes_of_a_lost_node_start_again_on_the_other(procs: ProcessScope, run_dir: Path,
                                                               tmp_path: Path) -> None:
    release = tmp_path / "release"
    job = procs.start(run_args(run_dir, "--hold-until", release, roles=("--nnodes", "1:2", "--rdzv-wait", "1",
                                                                       "--ps", "1", "--workers", "2")))
    wait_for(lambda: len(role_records(run_dir)) == 3, 20, "the PS and both workers to start")
    ps_pid = next(r["pid"] for r in role_records(run_dir) if r["role"] == "ps")
    agents = [proc for proc in psutil.process_iter(["cmdline"])
              if "agent" in (proc.info["cmdline"] or []) and str(run_dir) in " ".join(proc.info["cmdline"] or [])]
    assert len(agents) == 2, agents
    nodes = {(command := agent.cmdline())[command.index("--node-id") + 1]: agent for agent in agents}
    lost_node = next(node for node in nodes if node != node_of(ps_pid))
    agent = nodes[lost_node]
    lost = [r for r in role_records(run_dir) if node_of(r["pid"]) == lost_node]
    assert [r["role"] for r in lost] == ["worker"], "the node without the PS runs one worker (spread)"
    agent.kill()
    wait_for(lambda: len(role_records(run_dir)) == 3 + len(lost), 20, "the lost node's processes to start again")
    release.touch()
    result = job.wait()
    assert_succeeded(result, "ps x1, worker x2")
    assert re.search(r"node local\d left \(agent killed by SIGKILL\): going on with 1 nodes", result.stdout), \
        result.explain()
    again = role_records(run_dir)[3:]
    assert sorted((r["role"], r["rank"]) for r in again) == sorted((r["role"], r["rank"]) for r in lost)


@pytest.mark.parametrize("finish", ["after", "while_down"])
def test_a_killed_master_is_restarted_and_takes_the_role_processes_back(procs: ProcessScope, run_dir: Path,
                                                                       tmp_path: Path, finish: str) -> None:
    """``while_down``: the workers finish while no master runs; their agent's reports wait for the new one."""
    release = tmp_path / "release"
    job = procs.start(run_args(run_dir, "--hold-until", release))
    wait_for(lambda: len(role_records(run_dir)) == 3, 20, "the PS and both workers to start")
    master = next(child for child in psutil.Process(job.pid).children()
                  if "master" in child.cmdline() and str(run_dir) in " ".join(child.cmdline()))
    master.kill()
    if finish == "while_down":
        release.touch()
    job.wait_output(r"master resumed in round 1")
    job.wait_output(r"the restarted master takes back 3 role process\(es\)")
    release.touch()
    result = job.wait()
    assert_succeeded(result, "ps x1, worker x2")
    assert sorted((r["role"], r["rank"], r["incarnation"]) for r in role_records(run_dir)) == \
        [("ps", 0, 0), ("worker", 0, 0), ("worker", 1, 1)], "every process ran once, through the master's restart"
    assert "ps0 stopping" in (run_dir / "logs" / "roles" / "ps0.log").read_text(), "the new master stopped the PS"


def test_a_job_file_whose_roles_each_name_their_script_runs_without_a_job_script(procs: ProcessScope,
                                                                                 run_dir: Path,
                                                                                 tmp_path: Path) -> None:
    job_file = tmp_path / "job.toml"
    job_file.write_text(f'preload = []\nstop_grace = 1\n[roles.ps]\nentrypoint = "{ROLE_SCRIPT}"\n'
                        f'[roles.worker]\nentrypoint = "{ROLE_SCRIPT}"\ncount = 2\nargs = ["--fail-once", "1"]\n')
    result = procs.run(["run", "--run-dir", run_dir, job_file])
    assert_succeeded(result, "ps x1, worker x2")
    assert "worker1 fails on purpose" in result.stdout, "the role's own args reached its script"


def test_a_sigkilled_launcher_leaves_its_agents_to_stop_the_role_processes_gracefully(
        procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    """The launcher starts each agent's fork server but does not take it down with it: the agents, told by their
    parent-death signal, stop their processes with SIGTERM first, and the servers end as the agents do."""
    job = procs.start(run_args(run_dir, "--hold-until", tmp_path / "never"))
    wait_for(lambda: len(role_records(run_dir)) == 3, 20, "the PS and both workers to start")
    job.proc.kill()
    assert procs.wait_no_leftovers(timeout=20) == []
    assert "ps0 stopping" in (run_dir / "logs" / "roles" / "ps0.log").read_text(), "the PS got SIGTERM, not SIGKILL"
