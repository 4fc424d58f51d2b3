"""A real torch DDP (gloo, CPU) script, written for torchrun, runs unmodified under convoy and
survives a SIGKILL of one rank by restarting in a new round."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture

pytestmark = pytest.mark.slow


def test_unmodified_ddp_script_restarts_after_a_worker_is_killed(procs: ProcessScope, run_dir: Path,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "results"
    out.mkdir()
    # default --preload (torch): the standbys import torch while the round assembles, as in real use
    result = procs.run(["run", "--nnodes", "2", "--nproc-per-node", "1", "--stop-grace", "2", "--run-dir", run_dir,
                        fixture("ddp_train.py"), "--out", out, "--steps", 12, "--kill-rank", 1, "--kill-at-step", 4],
                       timeout=240)
    assert result.returncode == 0, result.explain()
    stdout = result.stdout
    # the killed rank's report usually arrives first; rank 0's gloo error ("connection closed by peer") may win
    assert re.search(r"^convoy: rank (1 \(node 1, local rank 0\) was killed by SIGKILL|0 \(node 0, local rank 0\) "
                     r"exited with code 1) in round 1$", stdout, re.MULTILINE), result.explain()
    assert "convoy: restart 1/3: opening round 2" in stdout
    assert "convoy: round 2: 2 nodes, world size 2" in stdout
    assert "convoy: job succeeded: all 2 workers finished" in stdout
    assert "[rank1]: rank 1: SIGKILL at step 4" in stdout
    assert "[rank0]: step 11 loss" in stdout and "world 2 attempt 1" in stdout

    finished = sorted(p.name for p in out.iterdir())
    assert finished == ["rank0.attempt1.json", "rank1.attempt1.json"], "only the restarted attempt finished"
    for rank in (0, 1):
        record = json.loads((out / f"rank{rank}.attempt1.json").read_text())
        assert (record["rank"], record["world_size"], record["steps"]) == (rank, 2, 12)
        assert record["in_sync"], "DDP kept every rank's parameters identical"
        assert math.isfinite(record["last_loss"])
    assert "rank 1: SIGKILL at step 4" in (run_dir / "logs" / "round1" / "rank1.log").read_text()
    assert "step 11 loss" in (run_dir / "logs" / "round2" / "rank0.log").read_text()
