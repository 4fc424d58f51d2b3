"""A finishing DDP worker exits promptly under the default preload (torch 2.13 gloo teardown hang), and a gloo
thread that finishes a collective during the exit cannot abort a process that ends with convoy's exit."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from helpers import FIXTURES, REPO, ProcessScope

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


def test_a_collective_finishing_during_the_exit_aborts_the_interpreters_teardown_not_convoys(
        procs: ProcessScope, tmp_path: Path) -> None:
    """Rank 0's gloo thread finishes an allreduce begun in a backward while rank 0 is exiting, and needs the GIL to
    free it (tests/fixtures/gloo_exit_race.py). Through Python's teardown the process aborts after its work is
    done, as the 4-rank strategy test's rank 0 did in CI (the strategy search's dry-run ranks ended that way too);
    through ``convoy.exit_without_teardown`` it exits 0."""
    from convoy.ports import unclaimed_port

    for ending, code in (("interpreter", -signal.SIGABRT), ("convoy", 0)):
        port = str(unclaimed_port())
        race_dir = tmp_path / ending
        race_dir.mkdir()
        ranks = [procs.start([ending], command=[sys.executable, str(FIXTURES / "gloo_exit_race.py")], env={
            "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1", "EXIT_RACE_DIR": str(race_dir)}) for rank in range(2)]
        first, second = (rank.wait(60) for rank in ranks)
        assert "rank 0: script done" in first.stdout, first.explain()
        assert second.returncode == 0 and "rank 1: allreduce done" in second.stdout, second.explain()
        assert first.returncode == code, f"{ending}: {first.explain()}"
        if ending == "interpreter":  # torch 2.13's abort; if a later torch stops aborting, this test says so here
            assert "terminate called without an active exception" in first.stderr, first.explain()
    assert procs.wait_no_leftovers() == []
