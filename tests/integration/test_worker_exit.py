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


def test_the_workers_that_lose_their_peer_are_one_line_each(procs: ProcessScope, tmp_path: Path) -> None:
    """A SIGKILLed rank is reported once; its peers' gloo tracebacks stay in their log files, one line each on
    the console."""
    example = str(Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py")
    run_dir = tmp_path / "run"
    result = procs.run(["run", "--nproc-per-node", "3", "--max-restarts", "0", "--run-dir", run_dir, example,
                        "--steps", "30", "--kill-rank", "2", "--kill-at-step", "5"])
    assert result.returncode == 1, result.explain()
    assert "Traceback" not in result.stdout, result.stdout
    lost = [rank for rank in (0, 1)
            if f"[rank{rank}]: convoy: lost its peer after rank 2 was killed by SIGKILL" in result.stdout]
    for rank in (0, 1):  # a peer stopped by its agent before gloo failed it has no traceback and no line
        if "Traceback" in (run_dir / "logs" / "round1" / f"rank{rank}.log").read_text():
            assert rank in lost, f"rank {rank}'s traceback is in its log, its line on the console: {result.stdout}"
