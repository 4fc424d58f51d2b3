"""``convoy run --scheduler ray`` on a real Ray cluster of this machine: a head and raylets started by ``ray
start`` (one CPU each, a custom resource on the nodes the jobs may use), a node lost by SIGKILL of its raylet."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from convoy.testing.ray_cluster import LocalRayCluster
from helpers import REPO, ProcessScope, wait_for

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "train_ddp.py")
PS_EXAMPLE = str(REPO / "examples" / "train_ps.py")
ON = ["--scheduler", "ray", "--ray-resource", "convoy_node=1"]
"""The jobs go on the nodes with ``convoy_node`` only: not on the head, where this test's drivers connect."""


@pytest.fixture(scope="module")
def cluster() -> LocalRayCluster:
    with LocalRayCluster(head_cpus=1) as cluster:
        for _ in range(2):
            cluster.add_node(1, {"convoy_node": 1})
        yield cluster


def _agents(run_dir: Path) -> set[str]:
    """The node ids the job's agents had (each names its Ray node), from their log folders' events."""
    events = (run_dir / "events.jsonl").read_text() if (run_dir / "events.jsonl").exists() else ""
    return set(re.findall(r"ray-[0-9a-f]{12}", events))


def _resumed_after_every_finished_step(run_dir: Path) -> int:
    """Each round's rank 0 began after the last step rank 0 finished in the rounds before (from the rounds' log
    files: on the console, the lines of one machine's several raylets come once per raylet, not in order); the last
    step finished."""
    last = -1
    rounds = sorted((run_dir / "logs").glob("round*"), key=lambda folder: int(folder.name.removeprefix("round")))
    for folder in rounds:
        text = (folder / "rank0.log").read_text() if (folder / "rank0.log").exists() else ""
        start = re.search(r"starting at step (\d+) \(round", text)
        assert start is None or int(start.group(1)) > last, f"{folder.name} resumed at {start.group(1)}, after {last}"
        last = max([last, *(int(step) for step in re.findall(r"step (\d+) loss", text))])
    return last


def test_a_job_grows_onto_a_joining_node_and_goes_on_when_one_is_lost(
        procs: ProcessScope, run_dir: Path, cluster: LocalRayCluster) -> None:
    job = procs.start(["run", *ON, "--address", cluster.address, "--nnodes", "2:3", "--run-dir", run_dir,
                       "--stop-grace", 2, EXAMPLE, "--steps", 100000, "--until", run_dir.parent / "end",
                       "--step-time", 0.05, "--persist-every", 0], env=cluster.driver_env)
    job.wait_output(r"round 1: 2 nodes", timeout=120)
    job.wait_output(r"\[rank0\]: step 20 loss")
    joined = cluster.add_node(1, {"convoy_node": 1})
    job.wait_output(r"growing to 3 nodes|round \d+: 3 nodes", timeout=60)
    job.wait_output(r"round \d+: 3 nodes", timeout=60)
    status = procs.run(["status", "--run-dir", run_dir])
    assert len(set(re.findall(r"ray-[0-9a-f]{12}", status.stdout))) == 3, status.stdout
    joined.kill()
    job.wait_output(r"node ray-[0-9a-f]{12} left .*going on with 2 nodes", timeout=60)
    last_round = job.wait_output(r"starting at step (\d+) \(round [3-9], world size 2", timeout=60)
    (run_dir.parent / "end").touch()  # the job ends after its next step (the steps were only a clock)
    result = job.wait(240)
    assert result.returncode == 0, result.explain()
    out = result.stdout
    assert "job succeeded" in out and "with 0 restart(s)" in out, out
    assert _resumed_after_every_finished_step(run_dir) >= int(last_round.group(1))
    assert len(_agents(run_dir)) == 3
    procs.wait_no_leftovers()


def test_a_job_of_roles_runs_on_ray_unchanged(procs: ProcessScope, run_dir: Path, cluster: LocalRayCluster) -> None:
    result = procs.start(["run", *ON, "--address", cluster.address, "--nnodes", 2, "--ps", 1, "--workers", 2,
                          "--run-dir", run_dir, PS_EXAMPLE, "--steps", 20, "--batch", 128, "--rows", 4000,
                          "--held-out", 2048], env=cluster.driver_env).wait(240)
    assert result.returncode == 0, result.explain()
    assert "[ps0]: parameter server 0 serving on port" in result.stdout, result.stdout
    assert "job succeeded" in result.stdout, result.stdout
    assert len(_agents(run_dir)) == 2
    procs.wait_no_leftovers()


def test_a_request_the_cluster_can_never_place_fails_in_bounded_time_naming_it(
        procs: ProcessScope, run_dir: Path, cluster: LocalRayCluster) -> None:
    began = time.monotonic()
    result = procs.run(["run", *ON, "--address", cluster.address, "--nnodes", 2, "--ray-gpus", 1,
                        "--placement-timeout", 3, "--run-dir", run_dir, EXAMPLE], timeout=60, env=cluster.driver_env)
    assert result.returncode == 2, result.explain()
    assert "GPU 1 per node: no node has any" in result.stderr, result.stderr
    assert "waited 3 s" in result.stderr and time.monotonic() - began < 30
    many = procs.run(["run", *ON, "--address", cluster.address, "--nnodes", 4, "--placement-timeout", 2,
                      "--run-dir", run_dir / "many", EXAMPLE], timeout=60, env=cluster.driver_env)
    assert many.returncode == 2 and "2 of the 4 node(s) MIN asks for" in many.stderr, many.explain()
    procs.wait_no_leftovers()


def test_no_cluster_and_no_ray_are_one_line_each(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    from convoy.ports import free_port

    nobody = f"127.0.0.1:{free_port()}"
    result = procs.run(["run", "--scheduler", "ray", "--address", nobody, "--run-dir", run_dir, EXAMPLE], timeout=30)
    assert result.returncode == 2 and f"no Ray cluster at {nobody}" in result.stderr, result.explain()
    shadow = tmp_path / "no_ray"
    (shadow / "ray").mkdir(parents=True)
    (shadow / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    result = procs.run(["run", "--scheduler", "ray", "--run-dir", run_dir, EXAMPLE], timeout=30,
                       env={"PYTHONPATH": str(shadow)})
    assert result.returncode == 2, result.explain()
    assert "pip install 'convoy[ray]'" in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_a_killed_driver_started_again_with_resume_takes_the_job_back(
        procs: ProcessScope, run_dir: Path, cluster: LocalRayCluster) -> None:
    job = procs.start(["run", *ON, "--address", cluster.address, "--nnodes", 2, "--run-dir", run_dir,
                       "--stop-grace", 2, EXAMPLE, "--steps", 100000, "--until", run_dir.parent / "end", "--step-time",
                       0.05, "--persist-every", 0], env=cluster.driver_env)
    job.wait_output(r"\[rank0\]: step 20 loss", timeout=120)
    os.kill(job.pid, signal.SIGKILL)  # the driver alone: its master ends with it, its agents' actors are detached
    assert job.wait(30).returncode == -signal.SIGKILL
    again = procs.start(["run", "--resume", run_dir], env=cluster.driver_env)
    wait_for(lambda: len(re.findall(r"took back the agent of node", again.stdout() + again.stderr())) == 2, 120,
             "the new driver to take back both agents")
    (run_dir.parent / "end").touch()
    result = again.wait(240)
    assert result.returncode == 0, result.explain()
    assert "master resumed in round 1" in result.stdout and "job succeeded" in result.stdout, result.explain()
    assert "with 0 restart(s)" in result.stdout, result.stdout
    assert len(re.findall(r"took back the agent of node ray-[0-9a-f]{12}", result.stdout + result.stderr)) == 2
    rank0 = (run_dir / "logs" / "round1" / "rank0.log").read_text()
    steps = [int(step) for step in re.findall(r"step (\d+) loss", rank0)]
    assert "starting at step" in rank0 and steps[-1] > 20, rank0[-2000:]  # round 1's workers went on to the end
    assert not (run_dir / "logs" / "round2").exists(), "the workers trained through the driver's death"
    refused = procs.run(["run", "--resume", run_dir / "nothing"])
    assert refused.returncode == 2 and "no ray_launch.json there" in refused.stderr, refused.explain()
    procs.wait_no_leftovers()


def test_a_job_of_higher_priority_gets_a_node_from_an_elastic_one_which_grows_back(
        procs: ProcessScope, tmp_path: Path, cluster: LocalRayCluster) -> None:
    # it runs until the test has seen it grow back (in one CI run a job of 320 steps finished before the priority
    # job had started, ended, and handed the node back)
    low = procs.start(["run", *ON, "--address", cluster.address, "--nnodes", "1:2", "--run-dir", tmp_path / "low",
                       "--stop-grace", 2, EXAMPLE, "--steps", 100000, "--until", tmp_path / "end", "--step-time", 0.05,
                       "--persist-every", 0], env=cluster.driver_env)
    low.wait_output(r"round 1: 2 nodes", timeout=120)
    low.wait_output(r"\[rank0\]: step 20 loss")
    high = procs.start(["run", *ON, "--address", cluster.address, "--nnodes", 1, "--priority", 10, "--run-dir",
                        tmp_path / "high", EXAMPLE, "--steps", 40, "--step-time", 0.05], env=cluster.driver_env)
    low.wait_output(r"giving node ray-[0-9a-f]{12} back to a job of higher priority", timeout=60)
    low.wait_output(r"going on with 1 nodes", timeout=60)
    finished = high.wait(120)
    assert finished.returncode == 0 and "job succeeded" in finished.stdout, finished.explain()
    low.wait_output(r"growing to 2 nodes", timeout=60)
    grown = low.wait_output(r"starting at step (\d+) \(round [3-9], world size 2", timeout=60)
    (tmp_path / "end").touch()
    result = low.wait(240)
    assert result.returncode == 0, result.explain()
    assert "with 0 restart(s)" in result.stdout and "its node given to a job of higher priority" in result.stdout
    assert _resumed_after_every_finished_step(tmp_path / "low") >= int(grown.group(1))
    procs.wait_no_leftovers()
