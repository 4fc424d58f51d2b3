"""A process tree's memory, sampled every few milliseconds on a thread, and its peak kept.

The peak is what the sizing model needs: USS, PSS and RSS summed over the tree, because a worker's data
loaders and helpers count too. The limits that use these readings are in ``memory_limits.py``. Torch-free,
no third-party imports.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from convoy.procs import TreeMemory, process_memory, sample_tree, tree_pids  # noqa: F401 (read here)

SAMPLE_INTERVAL_S = 0.005
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class MemoryPeak:
    """The highest value of each measure over a sampling window (each measure's own maximum)."""

    rss_bytes: int
    uss_bytes: int
    pss_bytes: int
    num_samples: int
    duration_s: float


def process_rss(pid: int) -> int:
    """One process's resident bytes from ``/proc/PID/statm`` (cheaper than smaps; 0 if it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def rss_tree(root_pid: int) -> TreeMemory:
    """The tree's RSS now, from ``statm`` (USS and PSS not read: 0)."""
    pids = tree_pids(root_pid)
    return TreeMemory(sum(process_rss(pid) for pid in pids), 0, 0, len(pids))


class TreeSampler:
    """Samples a process tree on a thread of its own and keeps the peak of each measure.

    ``window()`` returns the peak since the last call and starts a new window, so the agent can measure
    exactly one iteration: call it when the iteration starts and again when it ends. A sample reads
    ``smaps_rollup`` (milliseconds for a process that imported torch, under the process's memory-map lock),
    so the agent samples often only while it measures (``set_interval``). With ``rss_only`` its thread reads each
    process's RSS from ``statm`` instead (microseconds, no lock taken in the process): the peak RSS a process that
    does not measure needs, at a cost that does not grow with torch's memory map.
    """

    def __init__(self, root_pid: int, interval_s: float = SAMPLE_INTERVAL_S, rss_only: bool = False) -> None:
        self.root_pid, self.interval_s, self.rss_only = root_pid, interval_s, rss_only
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.latest = TreeMemory()
        self._reset_window()

    def _reset_window(self) -> None:
        self._rss = self._uss = self._pss = self._samples = 0
        self._window_start = time.monotonic()

    def start(self) -> TreeSampler:
        self._thread = threading.Thread(target=self._run, name=f"memory-sampler-{self.root_pid}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once(full=not self.rss_only)
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def set_interval(self, interval_s: float, rss_only: bool | None = None) -> None:
        """Sample every ``interval_s`` from now on (the next sample at once), RSS only or not if said."""
        self.interval_s = interval_s
        self.rss_only = self.rss_only if rss_only is None else rss_only
        self._wake.set()

    def sample_once(self, full: bool = True) -> TreeMemory:
        """Take one sample now (the thread calls this; a caller may too, e.g. right before reading a peak); not
        ``full``: RSS only (USS and PSS read 0 and leave their peaks as they are)."""
        sample = sample_tree(self.root_pid) if full else rss_tree(self.root_pid)
        with self._lock:
            self.latest = sample
            if sample.num_processes:
                self._rss, self._uss = max(self._rss, sample.rss_bytes), max(self._uss, sample.uss_bytes)
                self._pss = max(self._pss, sample.pss_bytes)
                self._samples += 1
        return sample

    @property
    def alive(self) -> bool:
        return self.latest.num_processes > 0 or Path(f"/proc/{self.root_pid}").exists()

    def peak(self) -> MemoryPeak:
        with self._lock:
            return MemoryPeak(self._rss, self._uss, self._pss, self._samples, time.monotonic() - self._window_start)

    def window(self) -> MemoryPeak:
        """The peak of the window that ends now; a new window starts."""
        with self._lock:
            peak = MemoryPeak(self._rss, self._uss, self._pss, self._samples, time.monotonic() - self._window_start)
            self._reset_window()
        return peak

    def stop(self) -> MemoryPeak:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        return self.peak()

    def __enter__(self) -> TreeSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
