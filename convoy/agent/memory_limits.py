"""A memory limit on a worker's process tree, and what it saw: whether the tree was OOM-killed, its peak.

The cgroup memory controller does the work (v2 ``memory.max``, or v1 ``memory.limit_in_bytes``), whichever
this host lets the agent write; where neither is writable, an RSS watchdog kills the tree once it passes the
limit, after one warning. Torch-free, no third-party imports.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from convoy.agent.memory import SAMPLE_INTERVAL_S, process_rss, tree_pids
from convoy.agent.reap import CGROUP_ROOT, cgroup_add, cgroup_pids, own_cgroup
from convoy.errors import ConfigError

CGROUP_V2, CGROUP_V1, WATCHDOG = "cgroup-v2", "cgroup-v1", "watchdog"
REMOVE_WAIT_S = 2.0


@dataclass(frozen=True)
class LimitOutcome:
    """What a limit saw. ``peak_bytes`` is the highest use it measured: the cgroup's own peak counter, or the
    watchdog's tree RSS. Under a cgroup the kernel stops the tree at the limit, so ``overshoot_bytes`` there is
    only what it let through (often 0): the demand beyond the limit is not observable; the watchdog sees it."""

    mechanism: str
    limit_bytes: int
    oom_kills: int
    peak_bytes: int
    overshoot_bytes: int

    @property
    def oom_killed(self) -> bool:
        return self.oom_kills > 0


class MemoryLimit:
    """A limit on the processes added to it and on everything they start."""

    mechanism = ""

    def __init__(self, name: str, limit_bytes: int) -> None:
        self.name, self.limit_bytes = name, limit_bytes

    def add(self, pid: int) -> bool:
        raise NotImplementedError

    def set_limit(self, limit_bytes: int) -> None:
        raise NotImplementedError

    def outcome(self) -> LimitOutcome:
        raise NotImplementedError

    def reset_peak(self) -> bool:
        """Start the peak over (to measure one iteration); False where this mechanism cannot."""
        raise NotImplementedError

    def close(self) -> None:
        """Kill what is still inside and release the limit."""
        raise NotImplementedError


class CgroupMemoryLimit(MemoryLimit):
    """A memory cgroup of its own; v2 also kills the whole group on OOM (``memory.oom.group``), as one worker."""

    def __init__(self, name: str, limit_bytes: int, path: Path, v2: bool) -> None:
        super().__init__(name, limit_bytes)
        self.path, self.v2 = path, v2
        self.mechanism = CGROUP_V2 if v2 else CGROUP_V1
        self._peak_fd: int | None = None

    @classmethod
    def create(cls, name: str, limit_bytes: int, parent: Path, v2: bool) -> CgroupMemoryLimit:
        """Make the cgroup under ``parent`` and set its limit; OSError where the kernel refuses."""
        path = parent / ("convoy-mem-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name))
        path.mkdir(exist_ok=True)
        limit = cls(name, limit_bytes, path, v2)
        try:
            if v2:
                _write_best_effort(path / "memory.swap.max", "0")
                _write_best_effort(path / "memory.oom.group", "1")
            else:  # charges already made by a process move in with it (a warm standby's imports)
                _write_best_effort(path / "memory.move_charge_at_immigrate", "3")
            limit.set_limit(limit_bytes)
        except OSError:
            limit.close()
            raise
        return limit

    def set_limit(self, limit_bytes: int) -> None:
        if self.v2:
            (self.path / "memory.max").write_text(f"{limit_bytes}\n")
        else:
            memory_file, swap_file = self.path / "memory.limit_in_bytes", self.path / "memory.memsw.limit_in_bytes"
            order = [swap_file, memory_file]  # memory+swap must stay >= memory: raise it first, lower it last
            if limit_bytes < int(memory_file.read_text().split()[0]):
                order.reverse()
            for file in order:
                if file is memory_file:
                    file.write_text(f"{limit_bytes}\n")
                else:  # without swap accounting the file is absent or refuses: memory alone is limited
                    _write_best_effort(file, str(limit_bytes))
        self.limit_bytes = limit_bytes

    def add(self, pid: int) -> bool:
        return cgroup_add(self.path, pid)

    def pids(self) -> list[int]:
        return cgroup_pids(self.path)

    def outcome(self) -> LimitOutcome:
        counters = _read_counters(self.path / ("memory.events" if self.v2 else "memory.oom_control"))
        peak_file = self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        try:
            text = os.pread(self._peak_fd, 64, 0).decode() if self._peak_fd is not None else peak_file.read_text()
            peak = int(text.split()[0])
        except (OSError, IndexError, ValueError):
            peak = 0
        kills = counters.get("oom_kill", 0)
        return LimitOutcome(self.mechanism, self.limit_bytes, kills, peak, max(0, peak - self.limit_bytes))

    def reset_peak(self) -> bool:
        """The cgroup's peak counter sees every spike (a sampler can miss one shorter than its interval); v1
        resets it by writing 0, v2 (kernel 6.12 and later) by writing to ``memory.peak``."""
        try:
            if not self.v2:
                (self.path / "memory.max_usage_in_bytes").write_text("0\n")
                return True
            if self._peak_fd is None:  # a v2 reset holds only for reads through the descriptor that wrote it
                self._peak_fd = os.open(self.path / "memory.peak", os.O_RDWR)
            os.write(self._peak_fd, b"0\n")
            return True
        except OSError:
            return False

    def close(self) -> None:
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None
        deadline = time.monotonic() + REMOVE_WAIT_S
        while (inside := self.pids()) and time.monotonic() < deadline:
            for pid in inside:
                _kill(pid)
            time.sleep(0.01)
        try:
            self.path.rmdir()
        except OSError:
            pass  # gone already, or a process is not dead yet: the node reap removes it later


class RssWatchdog(MemoryLimit):
    """Polls the tree's RSS and SIGKILLs the whole tree once it passes the limit: the fallback where no memory
    cgroup is writable. It acts a few milliseconds late, so the tree can pass the limit by what it allocates
    in that time, and the RSS counts pages shared within the tree more than once."""

    mechanism = WATCHDOG

    def __init__(self, name: str, limit_bytes: int, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        super().__init__(name, limit_bytes)
        self.interval_s = interval_s
        self._roots: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kills, self._peak, self._killed_at = 0, 0, 0
        self._thread = threading.Thread(target=self._run, name=f"memory-watchdog-{name}", daemon=True)
        self._thread.start()

    def add(self, pid: int) -> bool:
        if not Path(f"/proc/{pid}").exists():
            return False
        with self._lock:
            self._roots.append(pid)
        return True

    def set_limit(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._stop.wait(self.interval_s)

    def check(self) -> None:
        """One poll: measure the tree, kill it if it is past the limit."""
        with self._lock:
            roots = list(self._roots)
        pids = [pid for root in roots for pid in tree_pids(root)]
        rss = sum(process_rss(pid) for pid in pids)
        with self._lock:
            self._peak = max(self._peak, rss)
        if rss > self.limit_bytes and pids:
            for pid in pids:
                _kill(pid)
            with self._lock:
                self._kills += 1
                self._killed_at = max(self._killed_at, rss)
                self._roots = [root for root in self._roots if root not in pids]

    def reset_peak(self) -> bool:
        with self._lock:
            self._peak = 0
        return True

    def outcome(self) -> LimitOutcome:
        with self._lock:
            overshoot = max(0, self._killed_at - self.limit_bytes) if self._kills else 0
            return LimitOutcome(WATCHDOG, self.limit_bytes, self._kills, self._peak, overshoot)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            roots, self._roots = list(self._roots), []
        for pid in [pid for root in roots for pid in tree_pids(root)]:
            _kill(pid)


class MemoryLimiter:
    """Makes the limits of one agent: the first mechanism this host allows (cgroup v2, then v1, then the
    watchdog), chosen at the first limit and kept; falling back to the watchdog prints one warning.

    ``parent_v2``: the v2 cgroup to create limits under; by default the agent's own cgroup or its parent. In
    v2 a process is in one cgroup only, so a worker moved into its limit leaves the node's cgroup of
    ``reap.NodeCgroup`` (``close()`` kills what is left inside; the node reap's ``/proc`` scan still finds it).
    In v1 the memory hierarchy is apart from the node's. ``force_watchdog`` skips the cgroups.
    """

    def __init__(self, parent_v2: Path | None = None, force_watchdog: bool = False,
                 warn: Callable[[str], None] | None = None) -> None:
        self.parent_v2, self.force_watchdog = parent_v2, force_watchdog
        self.warn = warn or (lambda message: print(message, file=sys.stderr, flush=True))
        self.mechanism: str | None = None
        self.refusals: list[str] = []
        """Why each cgroup mechanism was not used (the warning quotes them)."""

    def limit(self, name: str, limit_bytes: int) -> MemoryLimit:
        if limit_bytes <= 0:
            raise ConfigError(f"memory limit for {name} is {limit_bytes} bytes; give a positive limit")
        if self.mechanism in (None, CGROUP_V2) and not self.force_watchdog:
            made = self._try(name, limit_bytes, True, self._v2_parent())
            if made is not None:
                return made
        if self.mechanism in (None, CGROUP_V1) and not self.force_watchdog:
            made = self._try(name, limit_bytes, False, _v1_parent())
            if made is not None:
                return made
        if self.mechanism is None:
            self.mechanism = WATCHDOG
            why = "; ".join(self.refusals) or "forced"
            self.warn(f"convoy: no writable memory cgroup ({why}); memory limits are enforced by an RSS watchdog "
                      "that kills a worker's processes a few ms after they pass the limit")
        elif self.mechanism != WATCHDOG:
            self.warn(f"convoy: the {self.mechanism} memory cgroup for {name} could not be made "
                      f"({self.refusals[-1]}); this one limit is enforced by an RSS watchdog")
        return RssWatchdog(name, limit_bytes)

    def _try(self, name: str, limit_bytes: int, v2: bool, parent: Path | None) -> MemoryLimit | None:
        label = CGROUP_V2 if v2 else CGROUP_V1
        if parent is None:
            self.refusals.append(f"{label}: no memory controller mounted for this process")
            return None
        try:
            made = CgroupMemoryLimit.create(name, limit_bytes, parent, v2)
        except OSError as exc:
            self.refusals.append(f"{label}: {parent}: {exc.strerror or exc}")
            return None
        self.mechanism = label
        return made

    def _v2_parent(self) -> Path | None:
        """The v2 cgroup to create under, one whose children get the memory controller: ``parent_v2``, else the
        agent's own cgroup, else its parent (a cgroup holding processes cannot enable controllers for children,
        but its parent has memory enabled for it wherever the agent's cgroup has the controller)."""
        own = _v2_own()
        candidates = [self.parent_v2] if self.parent_v2 is not None else [own, own.parent if own else None]
        for parent in candidates:
            if parent is None or "memory" not in _words(parent / "cgroup.controllers"):
                continue
            if "memory" in _words(parent / "cgroup.subtree_control"):
                return parent
            try:
                (parent / "cgroup.subtree_control").write_text("+memory\n")
                return parent
            except OSError:
                continue
        return None


def _v2_own() -> Path | None:
    for mount in (CGROUP_ROOT / "unified", CGROUP_ROOT):
        path = own_cgroup(None)
        if path is not None and (mount / "cgroup.controllers").is_file():
            return mount / path.lstrip("/")
    return None


def _v1_parent() -> Path | None:
    path = own_cgroup("memory")
    mount = CGROUP_ROOT / "memory"
    if path is None or not (mount / "memory.limit_in_bytes").is_file():
        return None
    return mount / path.lstrip("/")


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def _read_counters(path: Path) -> dict[str, int]:
    """``name value`` lines (memory.events, memory.oom_control) as a dict; empty if unreadable."""
    counters = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counters[parts[0]] = int(parts[1])
    return counters


def _write_best_effort(path: Path, value: str) -> None:
    """Set an optional knob; a kernel without it (or refusing it) leaves the default."""
    try:
        path.write_text(f"{value}\n")
    except OSError:
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
