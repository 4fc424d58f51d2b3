"""Real jobs that lose a worker and resume from the in-memory snapshot: exact results, no leaks."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch

from helpers import REPO, Launched, ProcessScope, Result
from convoy.runtime.persist import complete_checkpoints
from convoy.shm import SHM_DIR

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "train_ddp.py")
STEPS = 24
KILL_AT = 12


def _job_id(output: str) -> str:
    match = re.search(r"^convoy: job (\w+):", output, re.MULTILINE)
    assert match, output
    return match.group(1)


def _segments(job_id: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"convoy-{job_id}-*"))


def _train(procs: ProcessScope, run_dir: Path, nodes: int, nproc: int,
           *extra: str, persist_every: int = 0) -> tuple[Result, dict[str, torch.Tensor]]:
    out = run_dir.parent / f"{run_dir.name}-params.pt"
    result = procs.run(["run", "--nnodes", nodes, "--nproc-per-node", nproc, "--run-dir", run_dir, "--stop-grace", 2,
                        EXAMPLE, "--steps", STEPS, "--persist-every", persist_every, "--out", out, *extra])
    assert result.returncode == 0, result.explain()
    assert _segments(_job_id(result.stdout)) == [], "the job's shared memory outlived it"
    return result, torch.load(out)


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("persist_every", [0, 5])
def test_killed_worker_resumes_at_the_next_step_bit_identical(procs: ProcessScope, tmp_path: Path,
                                                              persist_every: int) -> None:
    """With persistence on too: saves in the background change nothing, the newer snapshot wins."""
    sync = ("--grad-sync", "allreduce")
    _, uninterrupted = _train(procs, tmp_path / "clean", 2, 1, *sync)
    result, resumed = _train(procs, tmp_path / "killed", 2, 1, *sync, "--kill-rank", "1", "--kill-at-step", KILL_AT,
                             persist_every=persist_every)
    if persist_every:
        saved = [step for step, _ in complete_checkpoints(tmp_path / "killed" / "checkpoints")]
        assert saved == [STEPS - 5, STEPS - 10], saved  # the newest two of steps 4, 9, 14, 19
    assert f"killing myself (rank 1) with SIGKILL in the middle of step {KILL_AT}" in result.stdout
    assert "restart 1/3" in result.stdout
    assert f"starting at step {KILL_AT} (round 2" in result.stdout, result.explain()
    assert f"in-memory snapshot of step {KILL_AT - 1}" in result.stdout
    for name in uninterrupted:
        assert torch.equal(uninterrupted[name], resumed[name]), name


def test_ddp_resume_differs_only_by_gradient_bucket_order(procs: ProcessScope, tmp_path: Path) -> None:
    """DDP rebuilds its buckets after the first step of every start, so with 4 ranks the
    float sums run in another order for one step: the results may differ in the last bits."""
    _, uninterrupted = _train(procs, tmp_path / "clean", 2, 2)
    result, resumed = _train(procs, tmp_path / "killed", 2, 2, "--kill-rank", "3", "--kill-at-step", KILL_AT)
    assert f"starting at step {KILL_AT} (round 2" in result.stdout, result.explain()
    difference = _max_difference(uninterrupted, resumed)
    print(f"largest parameter difference after a DDP resume: {difference:.3g}")
    assert difference <= 1e-5


def _started(procs: ProcessScope, run_dir: Path, *extra: str) -> tuple[Launched, str]:
    job = procs.start(["run", "--nnodes", 2, "--nproc-per-node", 1, "--run-dir", run_dir, "--stop-grace", 2,
                       EXAMPLE, "--steps", 400, "--step-time", 0.05, "--persist-every", 0, *extra])
    job.wait_output(r"\[rank0\]: step 5 loss")
    job_id = _job_id(job.stdout())
    snapshots = [name for name in _segments(job_id) if "-lease-" not in name]  # each node also holds a round lease
    assert len(snapshots) == 2, f"each rank should hold a snapshot while training: {snapshots}"
    return job, job_id


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_no_shared_memory_left_when_the_launcher_is_stopped(procs: ProcessScope, run_dir: Path, sig: int) -> None:
    job, job_id = _started(procs, run_dir)
    job.proc.send_signal(sig)
    result = job.wait(30)
    assert result.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), result.explain()
    procs.wait_no_leftovers(15)
    assert _segments(job_id) == []


def test_no_shared_memory_left_when_the_job_fails(procs: ProcessScope, run_dir: Path) -> None:
    job = procs.start(["run", "--nnodes", 2, "--nproc-per-node", 1, "--max-restarts", 0, "--run-dir", run_dir,
                       EXAMPLE, "--steps", 40, "--persist-every", 0, "--kill-rank", 1, "--kill-at-step", 10])
    result = job.wait()
    assert result.returncode == 1 and "no restarts left" in result.stdout, result.explain()
    assert _segments(_job_id(result.stdout)) == []
