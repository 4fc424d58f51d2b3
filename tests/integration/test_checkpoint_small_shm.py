"""A worker whose /dev/shm (a 2 MiB tmpfs in a private mount namespace) cannot hold its snapshots
trains to the end on persistent checkpoints alone, says so once, and resumes after a kill."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from helpers import FIXTURES, ProcessScope

pytestmark = pytest.mark.slow
MOUNT = "mount -t tmpfs -o size=2m tmpfs /dev/shm"


def _in_small_shm(procs: ProcessScope, tmp_path: Path, *args: object) -> tuple[int, str, str]:
    command = ["unshare", "-m", "sh", "-c", f'{MOUNT} && exec "$0" "$@"', sys.executable]
    job = procs.start([str(FIXTURES / "ckpt_small_shm.py"), *args], command=command,
                      env={"CONVOY_JOB_ID": f"smallshm{uuid.uuid4().hex[:8]}", "CONVOY_RUN_DIR": str(tmp_path),
                           "OMP_NUM_THREADS": "1"})
    result = job.wait()
    return result.returncode, result.stdout, result.stderr


def test_full_shared_memory_trains_on_with_persistent_saves_and_resumes_after_a_kill(
        procs: ProcessScope, tmp_path: Path) -> None:
    probe = subprocess.run(["unshare", "-m", "sh", "-c", MOUNT], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs on /dev/shm in a private mount namespace: {probe.stderr.decode().strip()}")
    code, out, err = _in_small_shm(procs, tmp_path, 6, 5)  # killed at step 5, after the save of step 3
    assert code == -9, (code, out, err)
    assert err.count("convoy checkpoint: in-memory snapshots turned off") == 1, err
    assert "persistent saves every 2 steps go on" in err and '"kind": "snapshot_disabled"' in err, err
    code, out, err = _in_small_shm(procs, tmp_path, 6, -1)
    assert code == 0 and "done" in out, (code, out, err)
    assert "starting at step 4 (persistent checkpoint" in out, out
    assert err.count("convoy checkpoint: in-memory snapshots turned off") == 1, err


def test_under_convoy_run_each_rank_says_once_that_its_snapshots_are_off(procs: ProcessScope, tmp_path: Path) -> None:
    """The worker's own line and the master's line for the recorded event were both printed: each rank's warning
    reached the console twice. The event (recorded, printed by the master) is the one line now."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", MOUNT], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs on /dev/shm in a private mount namespace: {probe.stderr.decode().strip()}")
    run_dir = tmp_path / "run"
    command = ["unshare", "-m", "sh", "-c", f'{MOUNT} && exec "$0" "$@"', sys.executable, "-m", "convoy"]
    result = procs.start(["run", "--nproc-per-node", 2, "--run-dir", run_dir, FIXTURES / "ckpt_small_shm.py", 4, -1],
                         command=command, env={"OMP_NUM_THREADS": "1"}).wait()
    assert result.returncode == 0, result.explain()
    for rank in (0, 1):
        said = [line for line in result.output.splitlines() if f"in-memory snapshots turned off on rank {rank}:" in line]
        assert len(said) == 1, said
        assert "persistent saves every 2 steps go on" in said[0], said
        logged = (run_dir / "logs" / "round1" / f"rank{rank}.log").read_text()
        assert logged.count('"kind": "snapshot_disabled"') == 1, logged  # the rank's log keeps its own record
