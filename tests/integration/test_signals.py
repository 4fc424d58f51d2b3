"""Stopping a job from outside: Ctrl-C, SIGTERM, SIGKILL of the launcher or of an agent.

Whatever happens to the launcher, no agent, standby or worker of the job may outlive it.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import psutil
import pytest
from helpers import CONVOY, Launched, ProcessScope, fixture, gone, read_pid, records, wait_for

from convoy.control.store import read_status

pytestmark = pytest.mark.slow

WORKER = fixture("worker.py")
ENV_DUMP = fixture("env_dump.py")


def start_long_job(procs: ProcessScope, run_dir: Path, record_dir: Path, *worker_args: object,
                   options: tuple = (), hold: str = "--hold") -> tuple[Launched, list[int]]:
    """A 2 x 2 job whose workers would run for a minute; returns once all four are running."""
    record_dir.mkdir()
    job = procs.start(["run", "--nnodes", "2", "--nproc-per-node", "2", "--preload", "", "--stop-grace", "1",
                       "--run-dir", run_dir, *options, WORKER, "--record", record_dir, hold, 60, *worker_args])
    pid_files = [record_dir / f"rank{rank}.round1.pid" for rank in range(4)]
    wait_for(lambda: all(p.exists() for p in pid_files), 60, "all four workers to start")
    return job, [read_pid(p) for p in pid_files]


def kill_agent_of(worker: int) -> str:
    """SIGKILL the agent that started ``worker``; returns its node id."""
    agent = psutil.Process(worker).parent()
    assert agent is not None and "agent" in agent.cmdline()
    node_id = agent.cmdline()[agent.cmdline().index("--node-id") + 1]
    agent.kill()
    return node_id


def test_sigint_to_the_launcher_stops_the_job_with_130(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    job, workers = start_long_job(procs, run_dir, tmp_path / "records")
    os.kill(job.pid, signal.SIGINT)
    result = job.wait(timeout=60)
    assert result.returncode == 130, result.explain()
    assert re.search(r"^convoy: job failed: .*interrupted", result.stdout, re.MULTILINE), result.explain()
    assert all(gone(pid) for pid in workers)
    assert procs.wait_no_leftovers(timeout=5) == []
    assert read_status(run_dir)["job"]["status"] == "failed"


def test_the_record_names_the_signal_that_stopped_the_job(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    job = procs.start(["run", "--preload", "", "--stop-grace", "1", "--run-dir", run_dir, WORKER, "--record",
                       record_dir, "--hold", 60])
    wait_for(lambda: (record_dir / "rank0.round1.pid").exists(), 60, "the worker to start")
    os.kill(job.pid, signal.SIGINT)
    result = job.wait(timeout=60)
    assert result.returncode == 130, result.explain()
    outcome = read_status(run_dir)["job"]["outcome"]
    assert "SIGINT" in outcome and "SIGTERM" not in outcome, outcome


def test_a_launcher_started_with_sigint_ignored_still_stops_on_it(procs: ProcessScope, run_dir: Path,
                                                                  tmp_path: Path) -> None:
    """A shell without job control (a script's ``convoy run ... &``, a CI runner) starts a command with SIGINT
    ignored; convoy run handles it all the same, as torchrun does: a SIGINT that reaches a launcher asks it to
    stop its job in order."""
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    ignoring = ["/bin/sh", "-c", "trap '' INT; exec \"$@\"", "sh", *CONVOY]
    job = procs.start(["run", "--preload", "", "--stop-grace", "1", "--run-dir", run_dir, WORKER, "--record",
                       record_dir, "--hold", 60], command=ignoring)
    wait_for(lambda: (record_dir / "rank0.round1.pid").exists(), 60, "the worker to start")
    os.kill(job.pid, signal.SIGINT)
    result = job.wait(timeout=60)
    assert result.returncode == 130, result.explain()
    assert "interrupted by SIGINT" in read_status(run_dir)["job"]["outcome"]
    assert procs.wait_no_leftovers(timeout=5) == []


@pytest.mark.parametrize(("options", "sig"), [
    ((), signal.SIGHUP),  # torchrun's default list: SIGTERM, SIGINT, SIGHUP, SIGQUIT
    ((), signal.SIGQUIT),
    (("--signals_to_handle", "SIGTERM,SIGUSR1"), signal.SIGUSR1),  # a scheduler's warning signal (SLURM's)
])
def test_a_signal_torchrun_handles_stops_the_job_in_order(procs: ProcessScope, run_dir: Path, tmp_path: Path,
                                                          options: tuple[str, ...], sig: signal.Signals) -> None:
    """torchrun's --signals-to-handle: each signal it names stops the job as SIGTERM does, 128+N and one line."""
    job = procs.start(["run", "--preload", "", "--stop-grace", "1", "--run-dir", run_dir, *options, ENV_DUMP,
                       "--out", tmp_path / "out", "--until", tmp_path / "never"])
    wait_for(lambda: (tmp_path / "out" / "rank0.json").exists(), 60, "the worker to start")
    os.kill(job.pid, sig)
    result = job.wait(timeout=60)
    assert result.returncode == 128 + sig, result.explain()
    assert re.findall(r"^convoy: job failed: .*", result.stdout, re.MULTILINE) == [
        f"convoy: job failed: interrupted by {sig.name}"], result.explain()
    assert "Traceback" not in result.output, result.explain()
    assert procs.wait_no_leftovers(timeout=5) == []


def test_a_job_started_under_nohup_outlives_its_terminal(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    """SIGHUP, ignored by nohup when the job started, stays ignored (torchrun handles it all the same, and a job
    started under nohup stops when its terminal closes)."""
    release = tmp_path / "release"
    nohup = ["/bin/sh", "-c", "trap '' HUP; exec \"$@\"", "sh", *CONVOY]
    job = procs.start(["run", "--preload", "", "--stop-grace", "1", "--run-dir", run_dir, ENV_DUMP, "--out",
                       tmp_path / "out", "--until", release], command=nohup)
    wait_for(lambda: (tmp_path / "out" / "rank0.json").exists(), 60, "the worker to start")
    os.kill(job.pid, signal.SIGHUP)
    release.touch()
    result = job.wait(timeout=60)
    assert result.returncode == 0, result.explain()
    assert read_status(run_dir)["job"]["status"] == "succeeded"


def test_ctrl_c_in_a_terminal_reaches_the_whole_group(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    """A terminal's Ctrl-C sends SIGINT to the launcher and its agents at once (one process group)."""
    job, workers = start_long_job(procs, run_dir, tmp_path / "records")
    os.killpg(job.pid, signal.SIGINT)
    result = job.wait(timeout=60)
    assert result.returncode == 130, result.explain()
    assert all(gone(pid) for pid in workers)
    assert procs.wait_no_leftovers(timeout=5) == []


def test_ctrl_c_in_a_terminal_ends_the_job_cleanly(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C is an ordinary way to stop a job: the console and the record say it failed, without tracebacks."""
    job, _ = start_long_job(procs, run_dir, tmp_path / "records")
    os.killpg(job.pid, signal.SIGINT)
    result = job.wait(timeout=60)
    assert result.returncode == 130, result.explain()
    assert "Traceback" not in result.output and "Exception occurred" not in result.output, result.explain()
    assert "convoy: job failed:" in result.stdout, result.explain()
    assert read_status(run_dir)["job"]["status"] == "failed"


def test_sigterm_to_the_launcher_exits_143(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    """One line says why, and no process prints a traceback: the master stops on the launcher's SIGTERM after
    the job it aborted has ended, and that signal must not break its shutdown."""
    job, workers = start_long_job(procs, run_dir, tmp_path / "records")
    os.kill(job.pid, signal.SIGTERM)
    result = job.wait(timeout=60)
    assert result.returncode == 143, result.explain()
    assert re.findall(r"^convoy: job failed: .*", result.stdout, re.MULTILINE) == [
        "convoy: job failed: interrupted by SIGTERM"], result.explain()
    assert "Traceback" not in result.output, result.explain()
    assert procs.wait_no_leftovers(timeout=5) == []
    assert all(gone(pid) for pid in workers)


def test_workers_that_ignore_sigterm_get_sigkill_after_the_grace(procs: ProcessScope, run_dir: Path,
                                                                 tmp_path: Path) -> None:
    job, workers = start_long_job(procs, run_dir, tmp_path / "records", "--ignore-term")
    os.kill(job.pid, signal.SIGINT)
    result = job.wait(timeout=60)
    assert result.returncode == 130, result.explain()
    assert all(gone(pid) for pid in workers), "SIGKILL after --stop-grace reached the stubborn workers"
    assert procs.wait_no_leftovers(timeout=5) == []


def test_sigkill_of_the_launcher_takes_agents_and_workers_down(procs: ProcessScope, run_dir: Path,
                                                               tmp_path: Path) -> None:
    job, workers = start_long_job(procs, run_dir, tmp_path / "records")
    agents = [p for p in psutil.Process(job.pid).children() if "agent" in p.cmdline()]
    assert len(agents) == 2
    os.kill(job.pid, signal.SIGKILL)
    job.wait(timeout=10)
    left = procs.wait_no_leftovers(timeout=15, pids=[*workers, *(agent.pid for agent in agents)])
    assert left == [], "agents (PDEATHSIG) and their workers must not outlive a killed launcher"


def test_sigkill_of_the_launcher_also_stops_workers_ignoring_sigterm(procs: ProcessScope, run_dir: Path,
                                                                     tmp_path: Path) -> None:
    job, workers = start_long_job(procs, run_dir, tmp_path / "records", "--ignore-term")
    os.kill(job.pid, signal.SIGKILL)
    job.wait(timeout=10)
    assert procs.wait_no_leftovers(timeout=15) == []


def test_sigkill_of_one_agent_kills_its_workers_and_the_job_ends(procs: ProcessScope, run_dir: Path,
                                                                 tmp_path: Path) -> None:
    """An agent killed with SIGKILL takes its workers with it (PDEATHSIG); the launcher must not then
    sit out the join timeout (10 minutes by default; 8 s here) waiting for a node that will never come back."""
    job, workers = start_long_job(procs, run_dir, tmp_path / "records", hold="--hold-first",
                                  options=("--join-timeout", 8))
    kill_agent_of(workers[3])
    wait_for(lambda: gone(workers[2]) and gone(workers[3]), 10, "the killed agent's workers to die with it")
    result = job.wait(timeout=30)
    assert result.returncode in (0, 1), result.explain()
    outcome = read_status(run_dir)["job"]["outcome"]
    assert "waited 8 s" not in outcome, f"the job ran into the join timeout: {outcome}"


def test_relaunch_replaces_a_killed_agent(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    job, workers = start_long_job(procs, run_dir, tmp_path / "records", hold="--hold-first", options=("--relaunch",))
    node_id = kill_agent_of(workers[3])
    result = job.wait(timeout=60)
    assert result.returncode == 0, result.explain()
    assert f"convoy: agent of node {node_id} killed by SIGKILL; relaunching it" in result.stdout
    assert "convoy: job succeeded: all 4 workers finished" in result.stdout
    assert sorted(records(tmp_path / "records", round_id=job_round(run_dir))) == [0, 1, 2, 3]
    assert all(gone(pid) for pid in workers)


def job_round(run_dir: Path) -> int:
    return int(read_status(run_dir)["job"]["round_id"])


def test_elastic_job_goes_on_with_fewer_nodes_after_losing_an_agent(procs: ProcessScope, run_dir: Path,
                                                                    tmp_path: Path) -> None:
    """--nnodes 1:2: when one agent dies, the job regroups at once on the node that is left."""
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    job = procs.start(["run", "--nnodes", "1:2", "--nproc-per-node", "2", "--preload", "", "--stop-grace", "1",
                       "--rdzv-wait", "0.5", "--run-dir", run_dir, WORKER, "--record", record_dir, "--hold-first", 60])
    pid_files = [record_dir / f"rank{rank}.round1.pid" for rank in range(4)]
    wait_for(lambda: all(p.exists() for p in pid_files), 60, "all four workers to start")
    workers = [read_pid(p) for p in pid_files]
    node_id = kill_agent_of(workers[3])
    result = job.wait(timeout=60)
    assert result.returncode == 0, result.explain()
    assert f"convoy: node {node_id} left (agent killed by SIGKILL): going on with 1 nodes (round 2)" in result.stdout
    assert "convoy: round 2: 1 nodes, world size 2" in result.stdout
    assert "convoy: job succeeded: all 2 workers finished" in result.stdout
    assert "with 0 restart(s)" in result.stdout, "losing a node is a regroup, not a restart"
    second = records(record_dir, round_id=2)
    assert sorted(second) == [0, 1], "the surviving node runs ranks 0-1"
    assert {r["env"]["WORLD_SIZE"] for r in second.values()} == {"2"}
    assert all(gone(pid) for pid in workers)


@pytest.mark.parametrize("escape", ["--grandchild", "--grandchild-session"])
def test_children_of_a_sigkilled_agents_workers_are_stopped(procs: ProcessScope, run_dir: Path, tmp_path: Path,
                                                            escape: str) -> None:
    """The workers die with their agent (PDEATHSIG); what they forked is re-parented to pid 1 and
    must be stopped too, even a child in a session of its own (the launcher reaps the node)."""
    record_dir = tmp_path / "records"
    job, workers = start_long_job(procs, run_dir, record_dir, escape, hold="--hold-first",
                                  options=("--relaunch",))
    children = {rank: read_pid(record_dir / f"rank{rank}.round1.child.pid") for rank in range(4)}
    kill_agent_of(workers[3])

    def reaped() -> bool:
        # Node 0's child may end only when its own agent restarts its workers for the next round,
        # which follows the master's record of the loss; the launcher reaps before it reports the
        # loss, so a child gone while no loss is on record was stopped by the reap of the other node.
        # Sample the child first: gone then and still no record afterwards means it went first.
        if gone(children[0]):
            kinds = {e["kind"] for e in read_status(run_dir, recent=200)["events"]}
            assert kinds & {"regroup", "restart"}, "the reap of the killed node stopped the other node's children"
        return gone(children[2]) and gone(children[3])

    wait_for(reaped, 10, "the children of the killed agent's workers to be stopped")
    result = job.wait(timeout=60)
    assert result.returncode == 0, result.explain()
    assert all(gone(pid) for pid in children.values())
    assert procs.wait_no_leftovers(timeout=10) == []


def test_the_next_agent_of_a_node_reaps_what_a_killed_one_left(procs: ProcessScope, tmp_path: Path) -> None:
    """By hand (no launcher to notice): an agent is SIGKILLed; the next agent started for the same
    node stops its predecessor's leftovers before it runs anything."""
    record_dir, run_dir = tmp_path / "records", tmp_path / "run"
    record_dir.mkdir()
    master = procs.start(["master", "--host", "127.0.0.1", "--port", 0, "--nnodes", 1, "--run-dir", run_dir,
                          "--heartbeat-timeout", 2])
    address = master.wait_output(r"convoy: master of job \w+ at (127\.0\.0\.1:\d+);", timeout=60).group(1)
    agent_args = ["agent", "--master", address, "--token-file", run_dir / "token", "--run-dir", run_dir,
                  "--node-id", "n0", "--nproc-per-node", 1, "--preload", "", "--stop-grace", 1,
                  WORKER, "--record", record_dir, "--grandchild-session", "--hold-first", 60]
    first = procs.start(agent_args)
    wait_for(lambda: (record_dir / "rank0.round1.child.pid").exists(), 60, "the worker's child to start")
    child = read_pid(record_dir / "rank0.round1.child.pid")
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    assert not gone(child), "a child in its own session outlives the agent (nothing else reaps it)"
    master.wait_output(r"node n0 sent no heartbeat", timeout=30)  # the node id is free again
    second = procs.start(agent_args)
    wait_for(lambda: gone(child), 30, "the next agent of node n0 to stop the child its predecessor's worker left")
    result = second.wait(timeout=60)
    assert result.returncode == 0, result.explain()
    assert "stopped 1 process(es) an earlier agent of this node left running" in result.stderr
    master.wait(timeout=30)
