"""A role's cpus enforced by the kernel: a busy process in its CFS cgroup gets at most its share of a CPU, and
where no cgroup is writable it is pinned to as many CPUs as it may use, the least used first."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from convoy.agent.cpu_limits import AFFINITY, CGROUP_V1, CGROUP_V2, PERIOD_US, CpuLimiter, _v1_parent, _v2_parent

BUSY = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_process() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", BUSY])


@pytest.mark.skipif(_v1_parent() is None and _v2_parent() is None, reason="no writable cpu cgroup on this host")
def test_a_busy_process_in_its_cgroup_gets_at_most_its_cpus() -> None:
    limiter = CpuLimiter()
    limit = limiter.limit("worker0", 0.25)
    assert limit.mechanism in (CGROUP_V1, CGROUP_V2) and limit.cgroup is not None
    assert limit.describe() == f"0.25 CPU(s) by {limit.mechanism}"
    proc = busy_process()
    try:
        (limit.cgroup / "cgroup.procs").write_text(f"{proc.pid}\n")
        start, began = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(1.5)
        share = (cpu_seconds(proc.pid) - start) / (time.monotonic() - began)
    finally:
        proc.kill()
        proc.wait()
    assert share < 0.4, f"a quarter of a CPU allowed, {share:.2f} used"
    limiter.release(limit)
    assert not limit.cgroup.exists(), "its cgroup goes with the limit"


def test_a_v2_limit_lives_in_the_processes_memory_cgroup(tmp_path: Path) -> None:
    """v2 holds a process in one cgroup: the CPU limit is written beside its memory limit (cpu.max)."""
    memory_cgroup = tmp_path / "convoy-mem-worker0"
    memory_cgroup.mkdir()
    limit = CpuLimiter().limit("worker0", 1.5, memory_cgroup, v2=True)
    assert (limit.mechanism, limit.cgroup, limit.own_cgroup) == (CGROUP_V2, memory_cgroup, False)
    assert (memory_cgroup / "cpu.max").read_text() == f"{int(1.5 * PERIOD_US)} {PERIOD_US}\n"
    limit.close()
    assert memory_cgroup.exists(), "the memory limit owns the cgroup"


def test_without_a_cgroup_the_process_is_pinned_to_the_least_used_cpus() -> None:
    limiter = CpuLimiter(cpus_allowed=(0, 1, 2, 3), mechanism=AFFINITY)
    first, second = limiter.limit("a", 1.5), limiter.limit("b", 1.0)
    assert (first.mechanism, first.pinned, second.pinned) == (AFFINITY, (0, 1), (2,))
    assert first.describe() == "1.5 CPU(s) by affinity on CPUs 0,1"
    limiter.release(first)
    assert limiter.limit("c", 2).pinned == (0, 1), "a released limit's CPUs are free again"
    mine = CpuLimiter(cpus_allowed=tuple(sorted(os.sched_getaffinity(0))), mechanism=AFFINITY).limit("d", 1)
    proc = busy_process()
    try:
        mine.apply(proc.pid)
        assert os.sched_getaffinity(proc.pid) == set(mine.pinned)
    finally:
        proc.kill()
        proc.wait()
