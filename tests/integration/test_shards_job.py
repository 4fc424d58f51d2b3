"""Dynamic data shards in a real job of roles: two workers train one epoch from the master's shards; one is
SIGKILLed mid-shard, restarts alone, and every item is still trained exactly once.

What "trained" counts: each worker reports progress after every item and writes the item to its own file only
once that report was accepted, so the files hold exactly the reported items. An item trained after the last
accepted report but before a kill is the one honest ambiguity of any progress protocol (the master cannot know
of it, so it is trained again); the killed worker here is killed while it waits after a report, so the count
over all files must be exactly one per item."""

from __future__ import annotations

import os
import re
import signal
from collections import Counter
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture, read_pid, wait_for

from convoy.control.store import read_status

pytestmark = pytest.mark.slow
ITEMS, SHARD_SIZE, HOLD_AFTER = 60, 10, 3


def test_a_worker_killed_mid_shard_loses_no_item_and_trains_none_twice(procs: ProcessScope, run_dir: Path) -> None:
    job = procs.start(["run", "--workers", "2", "--preload", "", "--stop-grace", "1", "--run-dir", run_dir,
                       fixture("shard_train.py"), "--items", ITEMS, "--shard-size", SHARD_SIZE,
                       "--hold-rank", 1, "--hold-after", HOLD_AFTER])
    held = run_dir / "held.pid"
    wait_for(lambda: held.exists() and held.read_text().strip(), 40, "worker 1 to report part of its first shard")
    os.kill(read_pid(held), signal.SIGKILL)
    result = job.wait()
    assert result.returncode == 0, result.explain()
    assert "convoy: job succeeded: every role finished (worker x2)" in result.stdout, result.explain()

    counts = Counter(int(line) for path in (run_dir / "trained").glob("*.txt") for line in path.read_text().split())
    assert sorted(counts) == list(range(ITEMS)), f"items never trained: {sorted(set(range(ITEMS)) - set(counts))}"
    assert [item for item, count in counts.items() if count != 1] == [], "items trained more than once"

    events = read_status(run_dir, recent=10_000)["events"]
    requeued = [e["message"] for e in events if e["kind"] == "shard_requeued"]
    assert len(requeued) == 1, requeued
    found = re.search(r"worker worker:1:\d+ was killed by SIGKILL; shard (\d+) items \[(\d+), (\d+)\)", requeued[0])
    assert found, requeued
    shard_id, start, stop = map(int, found.groups())
    assert (start, stop) == (shard_id * SHARD_SIZE + HOLD_AFTER, (shard_id + 1) * SHARD_SIZE), \
        "only the unreported rest of the shard went back"
    assert any(e["kind"] == "epoch_done" and f"{ITEMS} of {ITEMS} items trained once each" in e["message"]
               for e in events), [e["message"] for e in events if e["kind"].startswith(("shard", "epoch"))]
    assert "worker 1 failed (was killed by SIGKILL); restarting only it" in result.stdout, result.explain()
    procs.wait_no_leftovers()


def test_plain_workers_of_a_job_without_roles_share_the_shards(procs: ProcessScope, run_dir: Path) -> None:
    result = procs.run(["run", "--nproc-per-node", "2", "--preload", "", "--run-dir", run_dir,
                        fixture("shard_train.py"), "--items", 30, "--shard-size", 5])
    assert result.returncode == 0, result.explain()
    files = sorted((run_dir / "trained").glob("*.txt"))
    assert [path.name.split(".")[0] for path in files] == ["default0", "default1"], files
    items = sorted(int(line) for path in files for line in path.read_text().split())
    assert items == list(range(30)), "each item once, over both ranks"
    assert re.search(r"\[rank0\]: default0 trained \d+ items", result.stdout), result.explain()
