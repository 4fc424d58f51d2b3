"""The parameter-server example as a job of roles: two servers and two async workers learn the synthetic
teacher, and the servers are stopped when the workers are done."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import REPO, ProcessScope

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "train_ps.py")
SMALL = ["--steps", 40, "--batch", 128, "--rows", 4000, "--held-out", 4096]


def test_two_servers_and_two_async_workers_learn_the_teacher(procs: ProcessScope, run_dir: Path) -> None:
    result = procs.start(["run", "--ps", 2, "--workers", 2, "--run-dir", run_dir, EXAMPLE, *SMALL]
                         ).wait(240)
    assert result.returncode == 0, result.explain()
    out = result.stdout
    assert len(re.findall(r"\[ps\d\]: parameter server \d serving on port \d+", out)) == 2, out
    steps = [int(n) for n in re.findall(r"\[worker\d\]: worker \d: (\d+) steps, \d+ samples/s", out)]
    assert len(steps) == 2 and sum(steps) == 80, out  # the shards split the epoch's 80 batches between them
    found = re.search(r"\[worker0\]: held-out AUC ([\d.]+) \(teacher ([\d.]+)\) after 80 pushes per server", out)
    assert found, out
    learnt, teacher = float(found.group(1)), float(found.group(2))
    assert 0.6 < learnt < teacher, out
    assert "[worker0]: exactly once: each of the 80 batches applied once on each of 2 servers (0 repeated" in out, out
    assert "job succeeded" in out, out
    procs.wait_no_leftovers()
