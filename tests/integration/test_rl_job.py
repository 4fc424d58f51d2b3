"""The RL job end to end on real processes (``examples/rl_dqn.toml``, a short run): the four roles start in
order, the controller deals the slices and scales the actors from the measured rates, a SIGKILLed actor is
replaced without spending a restart and the buffer holds each transition once, the learners end the job with
the final line and the learning curve, and nothing is left running."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import psutil
import pytest
from helpers import REPO, ProcessScope

pytestmark = pytest.mark.slow

JOB = REPO / "examples" / "rl_dqn.toml"
SHORT = ["--set", "env_steps=5000", "--set", "learning_starts=300", "--set", "stop_return=0",
         "--set", "snapshot_every_s=0.5", "--set", "epsilon_steps=1000", "--set", "hidden=32"]


def test_a_short_dqn_job_scales_its_actors_replaces_a_killed_one_and_ends_with_its_curve(
        procs: ProcessScope, run_dir: Path) -> None:
    job = procs.start(["run", JOB, "--run-dir", run_dir, *SHORT, "--set", "step_cost=0.002"])
    job.wait_output(r"replay: serving 50000 transitions at 127\.0\.0\.1:\d+ \(scale mode\)", timeout=90)
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
    assert (run_dir / "learning-curve.png").stat().st_size > 1000
    assert procs.wait_no_leftovers() == []
