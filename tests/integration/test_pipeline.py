"""Every pipeline schedule on 4 real gloo ranks, with and without bubble filling, trains exactly
like one process (the checks run inside tests/fixtures/pipeline_check.py): per-micro-batch
losses, gradients and parameters."""

from __future__ import annotations

import re

import pytest

from helpers import FIXTURES, ProcessScope

pytestmark = pytest.mark.slow


def test_every_schedule_equals_a_single_process_run(procs: ProcessScope) -> None:
    outputs = procs.gloo_ranks(str(FIXTURES / "pipeline_check.py"), 4, [])
    for rank, output in enumerate(outputs):
        for name in ("gpipe", "1f1b", "interleaved2", "two-group", "1f1b-iw", "1f1b+fill", "gpipe+fill",
                     "two-group+fill"):
            assert f"rank {rank}: {name} ok" in output, output
        assert re.search(rf"^rank {rank}: ok \(\d+ checks\)", output, re.MULTILINE), output
    assert procs.wait_no_leftovers() == []
