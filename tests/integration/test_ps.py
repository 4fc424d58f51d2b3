"""Parameter servers on real processes (checks in tests/fixtures/ps_check.py): 2 servers and 1 worker at
staleness 0 train exactly as one process with torch's optimizers, through a server SIGKILLed and restored from
its saved shard; 2 workers at staleness 2 train asynchronously within the bound."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import pytest
from helpers import FIXTURES, ProcessScope

from convoy.worker.role_env import SERVICE_SECRET_ENV

pytestmark = pytest.mark.slow
CHECK = str(FIXTURES / "ps_check.py")


def job_env(run_dir: Path) -> dict[str, str]:
    """What an agent gives a job's processes: one secret for servers and workers, and the run dir where the
    servers may save and restore shards."""
    return {SERVICE_SECRET_ENV: secrets.token_hex(32), "CONVOY_RUN_DIR": str(run_dir)}


def ranks_ok(outputs: list[str]) -> None:
    for rank, output in enumerate(outputs):
        assert re.search(rf"^rank {rank}: ok \(\d+ checks\)", output, re.MULTILINE), output


def test_one_worker_at_staleness_0_trains_exactly_as_one_process_through_a_restored_server(
        procs: ProcessScope, tmp_path: Path) -> None:
    outputs = procs.gloo_ranks(CHECK, 3, ["exact", tmp_path], env=job_env(tmp_path))
    ranks_ok(outputs)
    assert int(re.search(r"ok \((\d+) checks\)", outputs[2]).group(1)) >= 3 * 8 * 2  # 3 optimizers x 8 steps
    assert sorted(p.name for p in tmp_path.glob("ps-*.pt")) == ["ps-0.pt", "ps-1.pt"]
    assert procs.wait_no_leftovers() == []


def test_two_async_workers_keep_the_staleness_bound_and_learn(procs: ProcessScope, tmp_path: Path) -> None:
    outputs = procs.gloo_ranks(CHECK, 4, ["async", tmp_path], env=job_env(tmp_path))
    ranks_ok(outputs)
    for worker, output in enumerate(outputs[2:]):
        lag = int(re.search(rf"^worker {worker}: max lag (\d+)", output, re.MULTILINE).group(1))
        assert 0 <= lag <= 2, output
    before, after = map(float, re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", outputs[2]).groups())
    assert after < 0.8 * before
    assert procs.wait_no_leftovers() == []
