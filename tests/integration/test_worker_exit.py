"""A finishing DDP worker exits promptly under the default preload (torch 2.13 gloo teardown hang)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import REPO, ProcessScope

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "benchmarks" / "scripts" / "ddp_steps.py")


def test_ddp_jobs_that_finish_always_exit(procs: ProcessScope, tmp_path: Path) -> None:
    """Without convoy's guard about half of these hung forever in ProcessGroupGloo's destructor."""
    for attempt in range(4):
        out = tmp_path / f"steps{attempt}"
        out.mkdir()
        result = procs.run(["run", "--nproc-per-node", 2, "--run-dir", tmp_path / f"run{attempt}", SCRIPT,
                            "--out", out, "--steps", 3], timeout=90)
        assert result.returncode == 0, result.explain()
        assert "job succeeded" in result.stdout
