"""The memory of a node's role processes: each one's limit enforced, its peak sampled, its measuring iteration.

Every role process gets a ``TreeSampler`` from its start (every few ms while one measures its role's iteration,
less often otherwise) and, when its assignment carries a limit, a ``MemoryLimit`` (a cgroup, else
the RSS watchdog, with one warning). The measuring iteration is marked by the script's worker events
(``convoy.worker.measure``), taken on the log pump's thread as the line arrives, so the sampling window opens and closes
with the iteration. ``report`` builds what the agent sends the master: the node's free memory, each process's
peak, and a finished measurement once. Torch-free.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from convoy import log
from convoy.agent.gpus import node_gpus
from convoy.agent.memory import MemoryPeak, TreeMemory, TreeSampler
from convoy.agent.memory_limits import MemoryLimit, MemoryLimiter
from convoy.agent.reap import CGROUP_ROOT, own_cgroup
from convoy.control.protocol import messages as p
from convoy.control.protocol.client import MasterClient
from convoy.errors import ConfigError, ConvoyError, MasterUnreachableError
from convoy.worker.measure import BASELINE, BEGIN, END

MEASURE_INTERVAL_S = 0.005
"""How often the measuring process is sampled during its measured iteration (RSS, USS and PSS from
``smaps_rollup``: a sample costs a few ms of CPU, so before and after it the process is sampled for RSS only)."""
PEAK_INTERVAL_S = 0.05
"""How often every role process's RSS is sampled from ``statm`` (its peak for status and the margin)."""
REPORT_S = 1.0
"""A memory report goes out at least this often while role processes run (at once when there is news)."""
NO_LIMIT = 2**60
Key = tuple[str, int, int]


def node_memory() -> tuple[int, int]:
    """(bytes this node can still give processes, the agent's cgroup memory limit or 0): MemAvailable, within
    what the agent's cgroup (v2 or v1) has left under its limit."""
    available = _meminfo("MemAvailable")
    limit = usage = 0
    v2 = own_cgroup(None)
    v1 = own_cgroup("memory")
    for path, limit_file, usage_file in ((v2, "memory.max", "memory.current"),
                                         (v1, "memory.limit_in_bytes", "memory.usage_in_bytes")):
        base = CGROUP_ROOT / ("" if limit_file == "memory.max" else "memory")
        if path is None or not (base / path.lstrip("/") / limit_file).is_file():
            continue
        limit, usage = _number(base / path.lstrip("/") / limit_file), _number(base / path.lstrip("/") / usage_file)
        break
    if 0 < limit < NO_LIMIT:
        return min(available, max(0, limit - usage)), limit
    return available, 0


@dataclass
class Watched:
    """One role process: its sampler, its limit, and its measuring iteration as the events mark it."""

    key: Key
    sampler: TreeSampler
    limit: MemoryLimit | None
    measure: bool
    baseline: TreeMemory | None = None
    shape: dict[str, int] = field(default_factory=dict)
    measuring: bool = False
    measured: p.MeasuredIterationReport | None = None
    sent_measured: bool = False


class _Sink:
    """What a role process's log pump puts its worker events on: the measurement's are taken here at once,
    the others queue up for the agent to send the master."""

    def __init__(self, owner: RoleMemory, key: Key) -> None:
        self.owner, self.key = owner, key

    def put(self, item: tuple[int, str, str]) -> None:
        self.owner.on_event(self.key, item)


class RoleMemory:
    """Limits and samplers of one node's role processes; calls come from the agent's loop and the log pumps."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.limiter = MemoryLimiter()
        self.watched: dict[Key, Watched] = {}
        self.events: queue.SimpleQueue[tuple[Key, str, str]] = queue.SimpleQueue()
        """Worker events of role processes other than the measurement's, for the master."""
        self._unsent: list[p.ProcessMemory] = []
        """Exited processes whose last figures (a measurement among them) the master has not had yet."""
        self._lock = threading.Lock()
        self._news = True
        self._sent_at = 0.0

    def sink(self, key: Key) -> _Sink:
        return _Sink(self, key)

    def limit_for(self, assignment: p.RoleAssignment) -> MemoryLimit | None:
        """The limit a process of this assignment gets, made before the process exists (a cgroup it joins
        before it runs anything); None without one, or where it cannot be made (said on stderr)."""
        if not assignment.memory_limit_bytes:
            return None
        name = f"{assignment.role}{assignment.rank}-{assignment.incarnation}-{secrets.token_hex(4)}"
        try:
            return self.limiter.limit(name, assignment.memory_limit_bytes)
        except ConfigError as exc:
            log.warning(f"convoy agent {self.node_id}: {exc}")
            return None

    def started(self, assignment: p.RoleAssignment, pid: int, limit: MemoryLimit | None = None) -> None:
        """Sample the process from now on and keep it under ``limit`` (``limit_for``'s; added to it here too,
        for a process that could not join it itself)."""
        key = (assignment.role, assignment.rank, assignment.incarnation)
        if limit is not None:
            limit.add(pid)
        # the measuring process too: it is sampled every few ms only between its iteration's begin and end
        watched = Watched(key, TreeSampler(pid, PEAK_INTERVAL_S, rss_only=True).start(), limit, assignment.measure)
        with self._lock:
            self.watched[key] = watched
            self._news = True

    def on_event(self, key: Key, item: tuple[int, str, str]) -> None:
        """A worker event of a role process, on its log pump's thread."""
        _, kind, message = item
        with self._lock:
            watched = self.watched.get(key)
        if watched is None or kind not in (BASELINE, BEGIN, END) or not watched.measure:
            if kind not in (BASELINE, BEGIN, END):
                self.events.put((key, kind, message))
            return
        sample = watched.sampler.sample_once()
        with self._lock:
            if kind == BASELINE:
                watched.baseline = _baseline(message) or sample
            elif kind == BEGIN and not watched.measuring and watched.measured is None:
                watched.baseline = watched.baseline or _baseline(message) or sample
                watched.shape = _shape(message)
                watched.sampler.window()
                watched.measuring = bool(watched.shape)
                if watched.measuring:
                    watched.sampler.set_interval(MEASURE_INTERVAL_S, rss_only=False)
            elif kind == END and watched.measuring:
                peak, watched.measuring = watched.sampler.window(), False
                watched.sampler.set_interval(PEAK_INTERVAL_S, rss_only=True)
                watched.measured = _measured(watched.shape, watched.baseline or TreeMemory(), peak, message)
            self._news = True

    def exited(self, key: Key, report: p.RoleReport) -> p.RoleReport:
        """The process ended: add to its exit report what its limit saw (an OOM kill) and its peak."""
        with self._lock:
            watched = self.watched.pop(key, None)
            self._news = True
        if watched is None:
            return report
        peak = watched.sampler.stop()
        report.memory_peak_bytes = peak.rss_bytes
        with self._lock:
            self._unsent.append(self._figures(watched))
        if watched.limit is not None:
            outcome = watched.limit.outcome()
            watched.limit.close()
            report.oom_killed, report.overshoot_bytes = outcome.oom_killed, outcome.overshoot_bytes
        return report

    def send(self, client: MasterClient, round_id: int) -> None:
        """Send the master the node's memory and its processes' peaks (at once after news), and the processes'
        other worker events (``round_id``: the round the node is in)."""
        report = self.report(time.monotonic())
        if report is not None:
            client.call("/memory", report, p.Ack)
        while not self.events.empty():
            (_, rank, _), kind, message = self.events.get_nowait()
            send_event(client, p.WorkerEvent(node_id=self.node_id, round_id=round_id, rank=rank, kind=kind,
                                             message=message[:4096]))

    def forget(self, key: Key) -> None:
        """A process stopped on purpose: its sampler stops and its limit is released."""
        with self._lock:
            watched = self.watched.pop(key, None)
            self._news = True
        if watched is not None:
            watched.sampler.stop()
            if watched.limit is not None:
                watched.limit.close()

    def report(self, now: float) -> p.MemoryReport | None:
        """What to send the master now: at once after news (a start, an exit, a measurement), else every
        REPORT_S while processes run; None: nothing to send yet."""
        with self._lock:
            if not self._news and (not self.watched or now - self._sent_at < REPORT_S):
                return None
            self._news, self._sent_at = False, now
            processes, self._unsent = self._unsent, []
            processes += [self._figures(one) for one in self.watched.values()]
        available, limit = node_memory()
        return p.MemoryReport(node_id=self.node_id, memory_available_bytes=available, memory_limit_bytes=limit,
                              processes=processes)

    def _figures(self, one: Watched) -> p.ProcessMemory:
        """A process's figures for the master; its measurement goes out once."""
        measured = one.measured if not one.sent_measured else None
        one.sent_measured = one.sent_measured or measured is not None
        return p.ProcessMemory(
            role=one.key[0], rank=one.key[1], incarnation=one.key[2], peak_rss_bytes=one.sampler.peak().rss_bytes,
            limit_bytes=one.limit.limit_bytes if one.limit else 0, mechanism=one.limit.mechanism if one.limit else "",
            measured=measured, measuring=one.measuring)

    def close(self) -> None:
        """The end of the job on this node: every sampler stops, every limit is released."""
        with self._lock:
            watched, self.watched = list(self.watched.values()), {}
        for one in watched:
            one.sampler.stop()
            if one.limit is not None:
                one.limit.close()


def join_memory(cpus: int = 0) -> dict[str, int]:
    """What a join tells the master of this node's memory, CPUs and GPUs (role processes are placed by them);
    ``cpus``: the CPUs the node offers (0: this process's CPU affinity)."""
    available, limit = node_memory()
    if not cpus:
        try:
            cpus = len(os.sched_getaffinity(0))
        except OSError:
            cpus = os.cpu_count() or 1
    return {"memory_available_bytes": available, "memory_limit_bytes": limit, "cpus": cpus, "gpus": len(node_gpus())}


def _measured(shape: dict[str, int], baseline: TreeMemory, peak: MemoryPeak, message: str) -> p.MeasuredIterationReport:
    return p.MeasuredIterationReport(
        **shape, activation_bytes=_end_figure(message, "activation_bytes"),
        gpu_peak_bytes=_end_figure(message, "gpu_peak_bytes"), peak_rss_bytes=peak.rss_bytes,
        peak_uss_bytes=peak.uss_bytes, baseline_rss_bytes=min(baseline.rss_bytes, peak.rss_bytes),
        baseline_uss_bytes=min(baseline.uss_bytes, peak.uss_bytes), duration_s=peak.duration_s,
        num_samples=peak.num_samples)


def _baseline(message: str) -> TreeMemory | None:
    """The tree's memory as the process read it when it wrote the line (``measure.memory_baseline`` and
    ``measure_iteration.begin``): the sample the agent takes on reading the line may be late, once the iteration
    has begun to allocate. None where the line carries none (an older convoy in the process) or it is not one."""
    try:
        body = json.loads(message)
        body = body.get("baseline", body) if isinstance(body, dict) else {}
        figures = [int(body[name]) for name in ("rss_bytes", "uss_bytes", "pss_bytes")]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if not all(0 < figure < 2**50 for figure in figures):
        return None
    return TreeMemory(*figures, num_processes=1)


def _shape(message: str) -> dict[str, int]:
    """The iteration's shape from its begin event; empty (no measurement) where it is not one."""
    try:
        body = json.loads(message)
        shape = {name: int(body[name]) for name in ("batch_size", "sample_bytes", "state_bytes")}
    except (ValueError, TypeError, KeyError):
        return {}
    valid = shape["batch_size"] >= 1 and shape["sample_bytes"] >= 1 and shape["state_bytes"] >= 0
    return shape if valid and max(shape.values()) < 2**50 else {}


def _end_figure(message: str, name: str) -> int | None:
    """A byte count the end event carries (``activation_bytes``, ``gpu_peak_bytes``); None where absent or bad."""
    try:
        value = json.loads(message).get(name)
    except (ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, (int, float)) and 0 <= value < 2**60 else None


def _meminfo(name: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _number(path: Path) -> int:
    try:
        text = path.read_text().strip()
        return NO_LIMIT if text == "max" else int(text)
    except (OSError, ValueError):
        return 0


def send_event(client: MasterClient, event: p.WorkerEvent) -> None:
    """Record ``event`` with the master; one it refuses (over the node's budget) is only logged: the line is in the
    process's log anyway. An unreachable master raises."""
    try:
        client.call("/event", event, p.Ack)
    except MasterUnreachableError:
        raise
    except ConvoyError as exc:
        log.warning(f"convoy agent {event.node_id}: event {event.kind} not recorded: {exc}")
