"""The DDP hook's thread and the main thread reduce at the same time on 4 real gloo ranks: the main
thread's collectives (on the default group and on the same HierarchicalAllreduce) are issued at
different points of backward on different ranks, so any group or segment the two threads shared
would pair different calls (tests/fixtures/collectives_concurrent.py does the checks)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import FIXTURES, ProcessScope

pytestmark = pytest.mark.slow
SCRIPT = str(FIXTURES / "collectives_concurrent.py")


@pytest.mark.parametrize("shm", [True, False], ids=["host-memory", "gloo"])
def test_hook_thread_and_main_thread_collectives_do_not_interleave(procs: ProcessScope, tmp_path: Path,
                                                                   shm: bool) -> None:
    before = set(Path("/dev/shm").glob("convoy-allreduce-*"))
    env = {"CONVOY_RUN_DIR": str(tmp_path), "CONVOY_ALLREDUCE_SHM": "1" if shm else "0"}
    outputs = procs.gloo_ranks(SCRIPT, 4, [json.dumps([[0, 1], [2, 3]])], env=env, timeout=120)
    for rank, output in enumerate(outputs):
        assert re.search(rf"^rank {rank}: ok$", output, re.MULTILINE), output
    assert set(Path("/dev/shm").glob("convoy-allreduce-*")) <= before, "a shared-memory file was left behind"
    assert procs.wait_no_leftovers() == []
