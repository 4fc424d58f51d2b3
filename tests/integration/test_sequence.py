"""Query-broadcast attention on 2 and 4 real gloo ranks equals single-device attention in
value and gradient (the checks run inside tests/fixtures/sequence_check.py)."""

from __future__ import annotations

import re

import pytest

from helpers import FIXTURES, ProcessScope

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world", [2, 4])
def test_query_broadcast_is_exact_and_refuses_bad_input(procs: ProcessScope, world: int) -> None:
    outputs = procs.gloo_ranks(str(FIXTURES / "sequence_check.py"), world, [])
    for rank, output in enumerate(outputs):
        assert re.search(rf"^rank {rank}: ok \(\d+ checks\)", output, re.MULTILINE), output
    assert procs.wait_no_leftovers() == []
