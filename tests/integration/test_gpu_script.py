"""The GPU benchmark script (issue 31) runs its whole path on a CPU, so it is known to work before a GPU machine
is lent: snapshots against dcp.async_save, a SIGKILLed trainer restored from shared memory, the strategy search
against its grid, one target line each, nothing left in /dev/shm. Its targets print `missed` off a GPU, saying
so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow


def test_the_gpu_script_runs_its_paths_on_a_cpu_and_leaves_no_segment(tmp_path: Path) -> None:
    job_id = f"gputest{os.getpid()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CONVOY_JOB_ID"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "benchmarks/gpu.py", "--quick", "--device", "cpu", "--skip-lookahead",
                             "--job-id", job_id], cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "from in-memory snapshot of step 2, resuming at step 3" in out, out
    targets = [line for line in out.splitlines() if line.startswith("target ")]
    assert [line.split(":")[0] for line in targets] == [
        "target snapshot_overhead", "target restore", "target lookahead_vs_greedy", "target lookahead_vs_prompt_lookup",
        "target strategy_pick_on_one_gpu"]
    assert all(line.endswith("missed") for line in targets) and "[not on a GPU]" in targets[0], targets
    assert "x the grid's best, 0 OOM" in targets[-1] and "[not on a GPU]" in targets[-1], targets
    assert not [path for path in Path("/dev/shm").iterdir() if job_id in path.name]


def test_a_cuda_run_without_a_gpu_is_refused_in_one_line() -> None:
    if subprocess.run([sys.executable, "-c", "import torch, sys; sys.exit(torch.cuda.is_available())"]).returncode:
        pytest.skip("this machine has a GPU")
    result = subprocess.run([sys.executable, "benchmarks/gpu.py", "--quick"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "torch sees no CUDA device here" in result.stderr and "--device cpu" in result.stderr


def test_a_dev_shm_too_small_for_the_snapshots_is_said_and_their_targets_missed() -> None:
    result = subprocess.run([sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--skip-lookahead",
                             "--skip-strategy", "--layers", "100000", "--hidden", "4096"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    targets = [line for line in result.stdout.splitlines() if line.startswith("target ")]
    assert targets[0].startswith("target snapshot_overhead: not run: two snapshots of this model need"), targets
    assert "GB in /dev/shm" in targets[1] and all(line.endswith("missed") for line in targets), targets
