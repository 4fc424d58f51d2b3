"""The roles runtime end to end on real processes: the example job (a two-rank role group that trains with DDP
and re-forms from its snapshots when a member is SIGKILLed, a service scaled from inside the job, elastic workers
preempted by a job of higher priority and grown back, the controller that starts after the service), and the
``replace`` policy (a replacement spends no restart; too many in the window fail
the job as a failure loop)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import REPO, ProcessScope, fixture, wait_for

pytestmark = pytest.mark.slow

DEMO = REPO / "examples" / "roles_demo.py"
ACTOR = fixture("replace_actor.py")


def demo_job(tmp_path: Path, steps: int, kill_at: int) -> Path:
    """The example's job file with a shorter run (its keys as the example has them)."""
    job = tmp_path / "roles_demo.toml"
    text = (REPO / "examples" / "roles_demo.toml").read_text()
    text = text.replace('entrypoint = "roles_demo.py"', f'entrypoint = "{DEMO}"')
    text = text.replace('args = ["--kill-trainer-at", "40"]', f'args = ["--steps", "{steps}", "--step-time", "0.01", '
                                                             f'"--kill-trainer-at", "{kill_at}", "--units", "200"]')
    assert str(DEMO) in text and "--units" in text, "the example's job file changed: update this test"
    job.write_text(text)
    return job


def test_the_demo_group_re_forms_alone_and_the_controller_scales_the_service(procs: ProcessScope,
                                                                              run_dir: Path, tmp_path: Path) -> None:
    result = procs.run(["run", demo_job(tmp_path, 60, 20), "--run-dir", run_dir])
    out = result.stdout
    assert result.returncode == 0, result.explain()
    assert "convoy: job succeeded: every role finished (trainer x2, echo x1, worker x4, controller x1)" in out
    assert "[trainer0]: trainer group round 1: world size 2, starting at step 0" in out
    assert "trainer 1 failed (was killed by SIGKILL); every process of role trainer starts again together (restart " \
           "1 of 3 for role trainer)" in out
    assert "[trainer0]: trainer group round 2: world size 2, starting at step 20 (restored from in-memory snapshot " \
           "of step 19" in out, result.explain()
    assert re.search(r"trainer: 60 of 60 steps trained, \d redone after a failure, 0 lost", out), result.explain()
    assert "controller: convoy.scale('echo', 4) refused: role echo can run 1..3 processes (its count is 1:3), not 4" \
        in out
    assert "convoy: role echo: 1 -> 3 process(es) (asked by controller 0: demo: more load on echo)" in out
    assert re.search(r"controller: echo runs 3 process\(es\): [\d.:]+, [\d.:]+, [\d.:]+\n", out), result.explain()
    assert "convoy: role echo: 3 -> 1 process(es) (asked by controller 0: demo: the load is gone)" in out
    assert "controller: echo runs 1 process(es)" in out
    preempted = re.findall(r"convoy: worker (\d) preempted: a job of higher priority asks for 1 CPU\(s\) more", out)
    assert sorted(preempted) == ["2", "3"], "the highest ranks, 0.5 CPU each: 1 CPU given back, no more"
    assert re.search(r"\[controller0\]: convoy preempt: 1 CPU\(s\) free after \d\.\d+ s \(priority 10\)", out)
    assert out.count("(grows back: the pool has room again)") == 2
    assert re.search(r"worker back at 4 processes \d+\.\d+ s after it ended", out), result.explain()
    assert re.search(r"\[worker\d\]: worker \d: no units left; 200 of 200 done, 0 twice, 0 lost", out), \
        result.explain()
    status = procs.run(["status", "--run-dir", run_dir]).stdout
    assert "  trainer (group round 2): 0 running, 0 pending of 2 wanted (count 2); on failure restart-role; " \
           "restarts 1" in status, status
    assert "  controller: 0 running, 0 pending of 1 wanted (count 1); on failure restart-job\n" in status, \
        "no process of another role restarted"
    assert "  echo (service): 0 running, 0 pending of 1 wanted (count 1:3); on failure restart-job\n" in status
    assert "  worker: 0 running, 0 pending of 4 wanted (count 1:4); on failure restart-one; preempted 2\n" in status
    started = re.findall(r"^  (\w+ \d+) \(incarnation \d+\) ", status, re.MULTILINE)  # the memory table's rows
    assert (started.count("controller 0"), started.count("echo 0"), started.count("trainer 1")) == (1, 1, 2), status


def actor_job(run_dir: Path, fail_times: int, max_replacements: int) -> list[object]:
    job = run_dir.parent / "actors.toml"
    job.write_text(f'entrypoint = "{ACTOR}"\nargs = ["--fail-rank", "1", "--fail-times", "{fail_times}"]\n'
                   f'nnodes = 2\nstop_grace = 1\npreload = []\nmax_restarts = 0\n'
                   f'[roles.actor]\ncount = 2\nfailure_policy = "replace"\nmax_replacements = {max_replacements}\n'
                   'replacement_window_s = 60\n')
    return ["run", job, "--run-dir", run_dir]


def test_a_replaced_actor_spends_no_restart(procs: ProcessScope, run_dir: Path) -> None:
    result = procs.run(actor_job(run_dir, fail_times=2, max_replacements=2))
    assert result.returncode == 0, result.explain()
    out = result.stdout
    assert out.count("replaced on any node with room, no restart spent") == 2, result.explain()
    assert "(2 of 2 within 60 s)" in out and "with 0 restart(s)" in out
    starts = (run_dir / "actor-starts.txt").read_text().split("\n")
    assert sorted(line.split()[0] for line in starts if line) == ["0", "1", "1", "1"]


def test_replacing_beyond_the_budget_is_a_failure_loop_that_fails_the_job(procs: ProcessScope,
                                                                          run_dir: Path) -> None:
    result = procs.run(actor_job(run_dir, fail_times=5, max_replacements=2))
    assert result.returncode != 0
    assert "role actor has replaced 2 process(es) within 60 s (its max_replacements): a failure loop, not bad luck" \
        in result.stdout, result.explain()


def test_a_process_that_ignores_its_preemption_notice_is_stopped_after_the_grace_and_the_job_goes_on(
        procs: ProcessScope, run_dir: Path) -> None:
    job = run_dir.parent / "hogs.toml"
    job.write_text(f'entrypoint = "{ACTOR}"\nargs = ["--work", "6"]\nnnodes = 1\nstop_grace = 1\npreload = []\n'
                   'preempt_grace = 0.5\n[roles.actor]\ncount = "1:2"\ncpus = 1\n')
    launched = procs.start(["run", job, "--run-dir", run_dir])
    launched.wait_output(r"convoy: round 1: ")
    assert procs.run(["scale", "--run-dir", run_dir, "actor=2"]).returncode == 0
    wait_for(lambda: "  actor: 2 running" in procs.run(["status", "--run-dir", run_dir]).stdout, 30,
             "both actors running")
    preempted = procs.run(["preempt", "--cpus", "1", "--priority", "5", "--seconds", "0.5"])
    assert preempted.returncode == 0, preempted.explain()
    assert re.search(r"convoy preempt: 1 CPU\(s\) free after (0\.[5-9]|1\.\d)\d* s", preempted.stdout), \
        "free once the ignored notice's grace (0.5 s) was over and SIGTERM ended it: " + preempted.stdout
    result = launched.wait()
    assert result.returncode == 0, result.explain()
    assert "convoy: actor 1 preempted: a job of higher priority asks for 1 CPU(s) more than the pool has free; " \
           "told to finish its unit of work, SIGTERM after 0.5 s" in result.stdout
    assert "convoy: role actor: 1 -> 2 process(es) (grows back: the pool has room again)" in result.stdout
    assert "with 0 restart(s)" in result.stdout, "a preempted process is released, not failed"


def test_a_group_across_roles_forms_and_forms_again_at_a_new_version_when_a_role_grows(procs: ProcessScope,
                                                                                       run_dir: Path) -> None:
    job = run_dir.parent / "cross.toml"
    job.write_text(f'entrypoint = "{fixture("cross_group.py")}"\nnnodes = 2\nstop_grace = 1\n'
                   '[roles.trainer]\ncount = 2\ngroup = true\n[roles.rollout]\ncount = "1:2"\nafter = []\n')
    result = procs.run(["run", job, "--run-dir", run_dir])
    assert result.returncode == 0, result.explain()
    lines = re.findall(r"\] ?: (\w+ \d): group rank (\d) of (\d) at version (\w+): weights \[([^\]]*)\], members "
                       r"counted (\d)", result.stdout)
    by_world: dict[str, list[tuple[str, ...]]] = {}
    for who, rank, world, version, weights, counted in lines:
        by_world.setdefault(world, []).append((who, rank, version, weights, counted))
    assert sorted(w[0] for w in by_world["3"]) == ["rollout 0", "trainer 0", "trainer 1"], result.explain()
    assert sorted(w[0] for w in by_world["4"]) == ["rollout 0", "rollout 1", "trainer 0", "trainer 1"]
    for world, seen in by_world.items():
        assert len({version for _, _, version, _, _ in seen}) == 1, "one version per membership"
        expected = ", ".join(f"{i * int(world)}.0" for i in range(4))
        assert all(weights == expected and counted == world for _, _, _, weights, counted in seen), seen
    assert by_world["3"][0][2] != by_world["4"][0][2], "the version changed with the members"
    assert "(asked by trainer 0: test: a second rollout)" in result.stdout
