"""convoy.agent.memory: the sampler's peak on real processes that allocate a known amount."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from convoy.agent.memory import TreeSampler, process_memory, process_rss, sample_tree, tree_pids

MIB = 1024 * 1024
ALLOCATE = 96 * MIB
TOLERANCE = 0.10

# Waits for a line, allocates the bytes it names (every page written), says so, waits for a line, frees them,
# says so, waits for a line, exits. With "fork" it does this in a child of its own instead.
ALLOCATOR = textwrap.dedent("""
    import subprocess, sys
    if sys.argv[1] == "fork":
        child = subprocess.Popen([sys.executable, __file__, "self"], stdin=sys.stdin, stdout=sys.stdout)
        sys.exit(child.wait())
    size = int(sys.stdin.readline())
    block = bytearray(b"\\x01") * size
    print("allocated", flush=True)
    sys.stdin.readline()
    del block
    print("freed", flush=True)
    sys.stdin.readline()
""")


@pytest.fixture
def allocator_script(tmp_path):
    path = tmp_path / "allocator.py"
    path.write_text(ALLOCATOR)
    return path


def _start(script, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(script), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _say(proc: subprocess.Popen[str], line: str, expect: str | None = None) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    if expect is not None:
        assert proc.stdout.readline().strip() == expect


def _wait_for_processes(root: int, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(tree_pids(root)) < count:
        assert time.monotonic() < deadline, f"the tree of {root} never had {count} processes"
        time.sleep(0.01)
    time.sleep(0.2)  # let the last one finish its imports


@pytest.mark.parametrize("mode, processes", [("self", 1), ("fork", 2)])
def test_the_peak_of_a_tree_is_what_it_allocated_within_tolerance(allocator_script, mode: str,
                                                                  processes: int) -> None:
    proc = _start(allocator_script, mode)
    try:
        _wait_for_processes(proc.pid, processes)
        before = sample_tree(proc.pid)
        assert before.num_processes == processes
        with TreeSampler(proc.pid) as sampler:
            _say(proc, str(ALLOCATE), "allocated")
            time.sleep(0.1)
            _say(proc, "free", "freed")
            time.sleep(0.1)
            after_free = sampler.latest
            peak = sampler.peak()
        assert peak.num_samples > 10, "sampled every few ms"
        for measure in ("rss_bytes", "uss_bytes"):
            grew = getattr(peak, measure) - getattr(before, measure)
            assert abs(grew - ALLOCATE) <= TOLERANCE * ALLOCATE, f"{measure}: grew {grew / MIB:.1f} MiB"
        assert after_free.rss_bytes < peak.rss_bytes - ALLOCATE // 2, "the peak is kept after memory is freed"
        _say(proc, "exit")
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_window_measures_one_stretch_and_starts_the_next(allocator_script) -> None:
    proc = _start(allocator_script, "self")
    try:
        _wait_for_processes(proc.pid, 1)
        sampler = TreeSampler(proc.pid)
        sampler.sample_once()
        quiet = sampler.window()
        _say(proc, str(ALLOCATE), "allocated")
        sampler.sample_once()
        busy = sampler.window()
        assert busy.rss_bytes - quiet.rss_bytes >= (1 - TOLERANCE) * ALLOCATE
        assert busy.num_samples == 1 and quiet.num_samples == 1
        _say(proc, "free", "freed")
        sampler.sample_once()
        assert sampler.window().rss_bytes < busy.rss_bytes - ALLOCATE // 2
        _say(proc, "exit")
        proc.wait(10)
    finally:
        proc.kill()
        proc.wait()


def test_measures_of_this_process_are_consistent() -> None:
    mine = process_memory(os.getpid())
    assert 0 < mine.uss_bytes <= mine.pss_bytes <= mine.rss_bytes
    assert abs(process_rss(os.getpid()) - mine.rss_bytes) <= 0.05 * mine.rss_bytes


def test_a_gone_process_reads_as_empty() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert tree_pids(proc.pid) == [] and sample_tree(proc.pid).num_processes == 0
    assert process_rss(proc.pid) == 0 and process_memory(proc.pid).rss_bytes == 0
    sampler = TreeSampler(proc.pid, interval_s=0.001).start()
    time.sleep(0.05)
    assert sampler.stop().num_samples == 0, "samples of nothing are not counted"


def test_a_sampler_samples_often_only_while_asked_and_at_once_when_asked() -> None:
    with TreeSampler(os.getpid(), interval_s=30.0) as sampler:
        time.sleep(0.2)
        assert sampler.peak().num_samples == 1, "a 30 s interval took more than its first sample"
        sampler.set_interval(0.005)
        time.sleep(0.3)
        fine = sampler.peak().num_samples
        assert fine >= 5, fine
        sampler.set_interval(30.0)
        time.sleep(0.1)
        settled = sampler.peak().num_samples
        time.sleep(0.3)
        assert sampler.peak().num_samples == settled, "it went on sampling every few ms"
        began = time.monotonic()
    assert time.monotonic() - began < 5, "stop waited out the 30 s interval"


# Marks its baseline, then allocates the bytes it names (every page written) before the agent has read the mark.
LATE_READER = textwrap.dedent("""
    import sys
    import convoy
    convoy.memory_baseline()
    block = bytearray(b"\\x01") * int(sys.argv[1])
    print("allocated", flush=True)
    sys.stdin.readline()
""")


def test_a_baseline_the_agent_reads_late_is_the_process_as_it_marked_it(tmp_path) -> None:
    """The agent reads a process's marked lines a little after they were written (its log pump, a loaded node):
    by then the measuring iteration may have allocated. The baseline is what the process read as it marked it."""
    from convoy.agent.role_memory import RoleMemory
    from convoy.control.protocol import messages as p
    from convoy.worker.events import parse
    from convoy.worker.measure import BASELINE

    script = tmp_path / "late.py"
    script.write_text(LATE_READER)
    proc = subprocess.Popen([sys.executable, str(script), str(64 * MIB)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    memory = RoleMemory("n0")
    try:
        assert proc.stdout.readline().strip() == "allocated"
        assignment = p.RoleAssignment(role="worker", rank=0, incarnation=0, world_size=1, measure=True)
        memory.started(assignment, proc.pid)
        marked = parse(proc.stderr.readline())
        assert marked is not None and marked[0] == BASELINE, marked
        memory.on_event(("worker", 0, 0), (0, *marked))
        baseline = memory.watched[("worker", 0, 0)].baseline
        assert baseline is not None and baseline.rss_bytes <= process_rss(proc.pid) - 60 * MIB, baseline
    finally:
        memory.close()
        proc.stdin.close()
        proc.wait(10)


def test_an_rss_only_sampler_keeps_the_rss_peak_from_statm_and_reads_uss_only_when_asked(allocator_script) -> None:
    """What the agent runs beside every role process that does not measure: RSS from ``statm`` (cheap, no lock in
    the sampled process), and a full sample (USS, PSS) only when it switches to measuring or asks for one."""
    proc = _start(allocator_script, "fork")
    try:
        _wait_for_processes(proc.pid, 2)
        with TreeSampler(proc.pid, interval_s=0.005, rss_only=True) as sampler:
            _say(proc, str(ALLOCATE), "allocated")
            time.sleep(0.1)
            peak = sampler.peak()
            assert sampler.latest.num_processes == 2 and sampler.latest.uss_bytes == 0
            assert peak.uss_bytes == peak.pss_bytes == 0 and peak.num_samples > 5
            assert abs(peak.rss_bytes - sample_tree(proc.pid).rss_bytes) <= TOLERANCE * ALLOCATE
            sampler.set_interval(0.005, rss_only=False)
            time.sleep(0.1)
            assert sampler.peak().uss_bytes >= (1 - TOLERANCE) * ALLOCATE, "measuring reads USS again"
        _say(proc, "free", "freed")
        _say(proc, "exit")
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()
