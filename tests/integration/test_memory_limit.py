"""convoy.agent.memory_limits on real processes: a tree that allocates past a real cgroup limit is OOM-killed and
reported as such; the RSS watchdog (forced) kills the whole tree past its limit, after one warning."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from convoy.agent.memory import tree_pids
from convoy.agent.memory_limits import (CGROUP_V1, CGROUP_V2, WATCHDOG, CgroupMemoryLimit, MemoryLimit,
                                        MemoryLimiter)
from convoy.errors import ConfigError

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
LIMIT = 96 * MIB
TOO_MUCH = 320 * MIB

# Waits for a line naming how many bytes to take, takes them 8 MiB at a time (every page written), prints
# "holding", waits for a line, exits 0. With "fork" it does this in a child of its own, so the limit must
# cover the whole tree; it forks once told to ("go"), after the test has put it under the limit.
ALLOCATOR = textwrap.dedent("""
    import subprocess, sys, time
    if sys.argv[1] == "fork":
        sys.stdin.readline()
        child = subprocess.Popen([sys.executable, __file__, "self"], stdin=sys.stdin, stdout=sys.stdout)
        sys.exit(child.wait())
    size, blocks = int(sys.stdin.readline()), []
    while sum(map(len, blocks)) < size:
        blocks.append(bytearray(b"\\x01") * (8 << 20))
        time.sleep(0.002)
    print("holding", flush=True)
    sys.stdin.readline()
""")


def _run_under(limit: MemoryLimit, script: Path, size: int, mode: str = "self") -> tuple[int, list[int]]:
    """Start the allocator, put it under ``limit`` before it allocates, let it take ``size`` bytes; returns its
    exit code and the tree it had."""
    proc = subprocess.Popen([sys.executable, str(script), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert limit.add(proc.pid)
        assert proc.stdin is not None and proc.stdout is not None
        if mode == "fork":  # only now: a child forked before the parent's move would stay outside the cgroup
            proc.stdin.write("go\n")
            proc.stdin.flush()
        deadline = time.monotonic() + 10
        while len(tree_pids(proc.pid)) < (2 if mode == "fork" else 1):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tree = tree_pids(proc.pid)
        if isinstance(limit, CgroupMemoryLimit):
            assert sorted(limit.pids()) == sorted(tree), "the tree, the child included, is inside the cgroup"
        proc.stdin.write(f"{size}\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() == "holding":
            proc.stdin.write("done\n")
            proc.stdin.flush()
        return proc.wait(30), tree
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def allocator(tmp_path: Path) -> Path:
    path = tmp_path / "allocator.py"
    path.write_text(ALLOCATOR)
    return path


@pytest.fixture
def cgroup_limiter() -> MemoryLimiter:
    limiter = MemoryLimiter(warn=lambda message: None)
    probe = limiter.limit(f"probe-{uuid.uuid4().hex[:8]}", LIMIT)
    probe.close()
    if limiter.mechanism == WATCHDOG:
        pytest.skip("no writable memory cgroup here: " + "; ".join(limiter.refusals))
    return limiter


def test_a_tree_past_a_cgroup_limit_is_oom_killed_and_reported(cgroup_limiter: MemoryLimiter, allocator: Path) -> None:
    limit = cgroup_limiter.limit(f"oom-{uuid.uuid4().hex[:8]}", LIMIT)
    try:
        assert limit.mechanism in (CGROUP_V1, CGROUP_V2)
        code, _ = _run_under(limit, allocator, TOO_MUCH, "fork")
        outcome = limit.outcome()
        assert outcome.oom_killed and outcome.oom_kills >= 1, outcome
        assert code != 0, "the allocating tree did not finish"
        assert outcome.peak_bytes <= LIMIT + 8 * MIB, f"the kernel held the tree at the limit: {outcome}"
    finally:
        limit.close()
    assert not limit.path.exists(), "the limit's cgroup is removed"


def test_a_tree_within_its_cgroup_limit_runs_and_a_raised_limit_lets_it_through(cgroup_limiter: MemoryLimiter,
                                                                                allocator: Path) -> None:
    limit = cgroup_limiter.limit(f"fits-{uuid.uuid4().hex[:8]}", LIMIT)
    try:
        code, _ = _run_under(limit, allocator, 32 * MIB)
        assert code == 0 and not limit.outcome().oom_killed
        assert limit.outcome().peak_bytes >= 32 * MIB, "the cgroup's peak counter saw the allocation"
        assert limit.reset_peak() and limit.outcome().peak_bytes < 32 * MIB, "the peak starts over"
        code, _ = _run_under(limit, allocator, 2 * LIMIT)
        assert code != 0 and limit.outcome().oom_kills == 1
        limit.set_limit(3 * LIMIT)  # a relaunch with the limit raised
        code, _ = _run_under(limit, allocator, 2 * LIMIT)
        assert code == 0 and limit.outcome().oom_kills == 1, "no second kill under the raised limit"
    finally:
        limit.close()


def test_the_watchdog_kills_the_whole_tree_past_its_limit_after_one_warning(allocator: Path) -> None:
    warnings: list[str] = []
    limiter = MemoryLimiter(force_watchdog=True, warn=warnings.append)
    limit = limiter.limit(f"dog-{uuid.uuid4().hex[:8]}", LIMIT)
    second = limiter.limit(f"dog-{uuid.uuid4().hex[:8]}", LIMIT)
    try:
        assert limit.mechanism == WATCHDOG and limiter.mechanism == WATCHDOG
        assert len(warnings) == 1 and "watchdog" in warnings[0], warnings
        code, tree = _run_under(limit, allocator, TOO_MUCH, "fork")
        outcome = limit.outcome()
        assert code == -9 and outcome.oom_killed, outcome
        assert outcome.overshoot_bytes > 0 and outcome.peak_bytes > LIMIT, outcome
        deadline = time.monotonic() + 5
        while any(Path(f"/proc/{pid}").exists() for pid in tree[1:]):
            assert time.monotonic() < deadline, "the watchdog killed the tree's child too"
            time.sleep(0.01)
        code, _ = _run_under(second, allocator, 16 * MIB)
        assert code == 0 and not second.outcome().oom_killed, "a tree under its limit is left alone"
    finally:
        limit.close()
        second.close()


def test_a_limit_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ConfigError, match="positive"):
        MemoryLimiter(force_watchdog=True).limit("worker0", 0)
