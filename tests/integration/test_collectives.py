"""Hierarchical allreduce across 4 real gloo ranks, for each way of grouping them: every algorithm
equals torch.distributed.all_reduce, bad input is refused on every rank, DDP with the hook trains
like plain DDP (the checks run inside tests/fixtures/collectives_check.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import FIXTURES, ProcessScope

pytestmark = pytest.mark.slow
SCRIPT = str(FIXTURES / "collectives_check.py")


@pytest.mark.parametrize("groups", [[[0, 1], [2, 3]], [[0, 1, 2, 3]], [[0], [1], [2], [3]], [[0], [1, 2, 3]]],
                         ids=["2x2", "1x4", "4x1", "uneven"])
def test_hierarchical_allreduce_equals_flat_and_trains_like_ddp(procs: ProcessScope, tmp_path: Path,
                                                                 groups: list[list[int]]) -> None:
    outputs = procs.gloo_ranks(SCRIPT, 4, [json.dumps(groups)], env={"CONVOY_RUN_DIR": str(tmp_path)})
    for rank, output in enumerate(outputs):
        assert re.search(rf"^rank {rank}: ok \(\d+ results checked", output, re.MULTILINE), output
    assert list((tmp_path / "collectives").glob("links-*.json")), "the measured links were not cached for the job"
    assert procs.wait_no_leftovers() == []
