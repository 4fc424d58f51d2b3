"""All-gather K/V, ring and Ulysses attention on 2 and 4 real gloo ranks equal single-device attention
in output and in dq, dk, dv, count their traffic, and refuse bad shapes (the checks run inside
tests/fixtures/sequence_baselines_check.py)."""

from __future__ import annotations

import re

import pytest

from helpers import FIXTURES, ProcessScope

pytestmark = pytest.mark.slow
SCRIPT = str(FIXTURES / "sequence_baselines_check.py")


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_baselines_equal_one_device(procs: ProcessScope, world: int) -> None:
    outputs = procs.gloo_ranks(SCRIPT, world, [])
    for rank, output in enumerate(outputs):
        assert f"rank {rank}: world ok" in output, output
        assert re.search(rf"^rank {rank}: ok \(\d+ checks\)", output, re.MULTILINE), output
    assert procs.wait_no_leftovers() == []
