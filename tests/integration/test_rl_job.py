"""The RL job end to end on real processes (``examples/rl_dqn.toml``, a short run): the four roles start in
order, the controller deals the slices and scales the actors from the measured rates, a SIGKILLed actor is
replaced without spending a restart and the buffer holds each transition once, the learners gather their samples
from the buffer's shared ring (one host), end the job with the final line and the learning curve, and nothing is
left running (no process, no segment in /dev/shm)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import psutil
import pytest
from helpers import REPO, ProcessScope, wait_for

pytestmark = pytest.mark.slow

JOB = REPO / "examples" / "rl_dqn.toml"
SHORT = ["--set", "env_steps=5000", "--set", "learning_starts=300", "--set", "stop_return=0",
         "--set", "snapshot_every_s=0.5", "--set", "epsilon_steps=1000", "--set", "hidden=32", "--set", "batch=64",
         "--set", "target_ratio=4"]


def test_a_short_dqn_job_scales_its_actors_replaces_a_killed_one_and_ends_with_its_curve(
        procs: ProcessScope, run_dir: Path) -> None:
    job = procs.start(["run", JOB, "--run-dir", run_dir, *SHORT, "--set", "step_cost=0.002"])
    ring = Path(job.wait_output(r"replay: serving 200000 transitions at 127\.0\.0\.1:\d+ \(scale mode\); learners on "
                                r"this host gather samples from (/dev/shm/convoy-\S+-replay0-ring-[0-9a-f]+)",
                                timeout=90).group(1))
    assert ring.exists()
    job.wait_output(r"controller: 16 slices dealt to 1 actor\(s\), each owned once", timeout=60)
    first = int(job.wait_output(r"actor 0: stepping CartPole-v1 \(pid (\d+), incarnation \d+\)").group(1))
    psutil.Process(first).send_signal(signal.SIGKILL)
    job.wait_output(r"actor 0 failed \(was killed by SIGKILL\).*replaced", timeout=30)
    job.wait_output(rf"actor 0: stepping CartPole-v1 \(pid (?!{first}\b)\d+, incarnation \d+\)", timeout=30)
    job.wait_output(r"controller: actor -> \d+: [\d.]+ samples/s over [\d.]+ inserts/s = [\d.]+ samples per insert, "
                    r"target 4: more actors to insert", timeout=90)
    result = job.wait(timeout=240)
    out = result.stdout
    assert result.returncode == 0, result.explain()
    final = re.search(r"final: mean return ([\d.]+) over the last (\d+) episodes after (\d+) environment steps", out)
    assert final is not None and int(final.group(3)) >= 5000, out
    assert "with 0 restart(s)" in out, out  # the replacement spent none
    assert re.search(r"learner: \d+ steps in [\d.]+ s; buffer inserted \d+, sampled \d+, refused 0, 0 sent twice",
                     out), out
    assert re.search(r"learner 0: training .*; samples gathered here from the shared ring convoy-\S+-replay0-ring-",
                     out), out
    assert (run_dir / "learning-curve.png").stat().st_size > 1000
    assert procs.wait_no_leftovers() == []
    assert not ring.exists(), "the ring ends with the job"


def learners_take_cpus(where: Path) -> Path:
    """The example's job file with its learners taking 0.5 CPU each (so that they hold some of the pool)."""
    text = JOB.read_text().replace('entrypoint = "rl_dqn.py"', f'entrypoint = "{JOB.parent / "rl_dqn.py"}"')
    text = text.replace('[roles.learner]\n', '[roles.learner]\ncpus = 0.5\n')
    assert "cpus = 0.5" in text and str(JOB.parent) in text, "the example's job file changed: update this test"
    (where / "rl_cpus.toml").write_text(text)
    return where / "rl_cpus.toml"


def test_a_job_of_higher_priority_takes_actors_then_a_learner_and_the_rl_job_grows_back(
        procs: ProcessScope, run_dir: Path) -> None:
    """The pool has 2 CPUs (the test's own); actors take 0.25 each (the example's) and learners 0.5 (the example's
    job file with one line more). A priority job
    asks for 1.25 CPUs while 4 actors and 2 learners hold them all: 3 actors cut their episodes, flush and leave
    (their transitions in the buffer's snapshot), then learner 1: both learners leave at the same step and learner 0
    forms the group again from its snapshot; when the priority job ends, the roles grow back and the group of 2 goes
    on from where it left."""
    job = procs.start(["run", learners_take_cpus(run_dir.parent), "--run-dir", run_dir, *SHORT, "--set",
                       "env_steps=1000000", "--set",
                       "mode=none", "--set", "step_cost=0.002", "--set", "snapshot_every_s=2"])
    job.wait_output(r"controller: 16 slices dealt to 1 actor\(s\)", timeout=90)
    assert procs.run(["scale", "--run-dir", run_dir, "actor=4", "learner=2"]).returncode == 0
    job.wait_output(r"controller: 16 slices dealt to 4 actor\(s\)", timeout=60)
    job.wait_output(r"learner 1: training CartPole-v1 \(pid \d+\), world size 2", timeout=60)
    preempt = procs.run(["preempt", "--cpus", "1.25", "--priority", "5", "--seconds", "2"], timeout=60)
    assert preempt.returncode == 0, preempt.explain()
    assert re.search(r"convoy preempt: 1\.25 CPU\(s\) free after \d+\.\d+ s \(priority 5\)", preempt.stdout)
    for rank in (1, 2, 3):
        job.wait_output(rf"actor {rank}: preempted: episode cut at step \d+; \d+ transitions inserted, 0 not yet in "
                        r"the buffer's snapshot", timeout=30)
    left = {int(job.wait_output(rf"learner {rank}: left at (\d+) steps trained, as told \(a member preempted\); the "
                                "group forms again from its snapshot", timeout=30).group(1)) for rank in (0, 1)}
    assert len(left) == 1, f"the group leaves at one step, not {left}"
    job.wait_output(r"role learner: 1 -> 2 process\(es\) \(grows back: the pool has room again\)", timeout=60)
    job.wait_output(r"role actor: 3 -> 4 process\(es\) \(grows back: the pool has room again\)", timeout=60)
    job.wait_output(r"controller: 16 slices dealt to 4 actor\(s\), each owned once", timeout=60)
    pair = r"learner 0: training CartPole-v1 \(pid \d+\), world size 2, from step (\d+)"
    wait_for(lambda: len(re.findall(pair, job.stdout())) == 2, 60, "the group of 2 formed again")
    resumed = int(re.findall(pair, job.stdout())[-1])
    assert resumed >= left.pop(), "no finished step lost: the group of 2 goes on from its snapshots"
    assert procs.run(["config", "set", "--run-dir", run_dir, "env_steps=1"]).returncode == 0
    result = job.wait(timeout=120)
    assert result.returncode == 0, result.explain()
    out = result.stdout
    assert len(re.findall(r"convoy: (actor [123]|learner 1) preempted: a job of higher priority asks for 1\.25 "
                          r"CPU\(s\) more", out)) == 4, out
    assert "with 0 restart(s)" in out, "preempted processes are released, not failed"
    assert "Traceback" not in out, out
    assert re.search(r"buffer inserted \d+, sampled \d+, refused 0, 0 sent twice", out), out
    assert procs.wait_no_leftovers() == []
