"""Hierarchical allreduce across 4 real gloo ranks, for each way of grouping them: every algorithm
equals torch.distributed.all_reduce, bad input is refused on every rank, DDP with the hook trains
like plain DDP (the checks run inside tests/fixtures/collectives_check.py). Groups of more than one
rank run their in-group phases through shared memory, or through gloo where that is turned off;
either way no shared-memory file is left behind."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import FIXTURES, ProcessScope

pytestmark = pytest.mark.slow
SCRIPT = str(FIXTURES / "collectives_check.py")


@pytest.mark.parametrize(("groups", "shm"), [([[0, 1], [2, 3]], True), ([[0, 1], [2, 3]], False),
                                             ([[0, 1, 2, 3]], True), ([[0], [1], [2], [3]], True),
                                             ([[0], [1, 2, 3]], True)],
                         ids=["2x2", "2x2-gloo", "1x4", "4x1", "uneven"])
def test_hierarchical_allreduce_equals_flat_and_trains_like_ddp(procs: ProcessScope, tmp_path: Path,
                                                                 groups: list[list[int]], shm: bool) -> None:
    before = set(Path("/dev/shm").glob("convoy-allreduce-*"))
    env = {"CONVOY_RUN_DIR": str(tmp_path), "CONVOY_ALLREDUCE_SHM": "1" if shm else "0"}
    outputs = procs.gloo_ranks(SCRIPT, 4, [json.dumps(groups)], env=env)
    for rank, output in enumerate(outputs):
        assert re.search(rf"^rank {rank}: ok \(\d+ results checked", output, re.MULTILINE), output
        shared = shm and any(rank in group and len(group) > 1 for group in groups)
        assert f"host memory: {shared})" in output, output
    assert set(Path("/dev/shm").glob("convoy-allreduce-*")) <= before, "a shared-memory file was left behind"
    assert list((tmp_path / "collectives").glob("links-*.json")), "the measured links were not cached for the job"
    assert procs.wait_no_leftovers() == []
