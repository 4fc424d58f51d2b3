"""The sequence-parallel example trains: on 4 gloo ranks, the copy task's loss (which needs
attention across ranks) falls far below chance."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from helpers import ProcessScope

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_sequence_parallel.py"


def test_copy_task_is_learnt_with_sequence_parallel_degree_4(procs: ProcessScope) -> None:
    outputs = procs.gloo_ranks(str(EXAMPLE), 4, ["--steps", "90"])
    found = re.search(r"copy loss ([\d.]+) -> ([\d.]+) \(chance ([\d.]+)\)", outputs[0])
    assert found, outputs[0]
    first, last, chance = (float(x) for x in found.groups())
    assert chance == pytest.approx(math.log(16), abs=1e-3)
    assert first > 0.8 * chance and last < 0.2 * chance, outputs[0]
    assert procs.wait_no_leftovers() == []
