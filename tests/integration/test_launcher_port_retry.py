"""MASTER_PORT taken between the join and rank 0's bind: a new round with a new port, not a restart. Where rank 0's
process serves the round's store (the default), the agent hands it the port it has held since the join, so no
other program can take it; the gap exists where rank 0's ``init_process_group`` hosts the store, as with
torchrun's opt-out (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), which this test sets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture

pytestmark = pytest.mark.slow


def test_a_taken_master_port_is_retried_in_a_new_round_without_a_restart(procs: ProcessScope,
                                                                          run_dir: Path) -> None:
    result = procs.run(["run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "0", "--stop-grace", "1",
                        "--run-dir", run_dir, fixture("port_taken_train.py")],
                       env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, timeout=150)
    assert result.returncode == 0, result.explain()
    taken = re.search(r"convoy: MASTER_PORT (\d+) was taken before rank 0 could bind it: opening round 2 with a new "
                      r"port \(retry 1/3, not a restart\)", result.stdout)
    assert taken, result.explain()
    trained = re.findall(r"rank (\d) round 2 port (\d+) sum 2", result.stdout)
    assert sorted(rank for rank, _ in trained) == ["0", "1"], result.explain()
    assert trained[0][1] != taken.group(1), "round 2 has a port of its own"
    assert "with 0 restart(s)" in result.stdout
