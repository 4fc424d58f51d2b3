"""``--log-level`` sets what the whole job says of itself (launcher, master, agents), never the workers' output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import REPO, ProcessScope

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "train_ddp.py")


def test_the_job_speaks_at_its_level_and_the_workers_always(procs: ProcessScope, tmp_path: Path) -> None:
    quiet = procs.run(["run", "--nnodes", 2, "--log-level", "warning", "--run-dir", tmp_path / "quiet", EXAMPLE,
                       "--steps", 6])
    assert quiet.returncode == 0, quiet.explain()
    assert "[rank0]: step 5 loss" in quiet.stdout
    assert "convoy:" not in quiet.stdout + quiet.stderr, quiet.explain()  # no round, no outcome, no timing
    chatty = procs.run(["run", "--log-level", "debug", "--run-dir", tmp_path / "debug", EXAMPLE, "--steps", 3])
    assert chatty.returncode == 0, chatty.explain()
    out = chatty.stdout
    for line in (r"DEBUG convoy: started convoy master \(pid \d+\)", r"INFO convoy: round 1: 1 nodes",
                 r"DEBUG convoy agent local0: round 1: starting 1 worker\(s\), ranks 0..0 of 1",
                 r"INFO convoy: job succeeded"):  # the agent and the master inherit the launcher's level
        assert re.search(line, out), (line, out)
    assert "[rank0]: step 2 loss" in out
    assert procs.wait_no_leftovers() == []
