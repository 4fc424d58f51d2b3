"""A CPU limit on a role process's tree: the ``cpus`` its role declares, enforced by the kernel.

The CFS bandwidth controller does it where the agent may write it: cgroup v2 ``cpu.max`` (in the process's memory
cgroup when it has one, since a v2 process is in one cgroup only) or v1 ``cpu.cfs_quota_us``. Elsewhere the
process is pinned to as many CPUs as it may use (rounded up), the least used of the node's first. Each limit says
which mechanism holds it. Torch-free, no third-party imports.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from convoy.agent.reap import CGROUP_ROOT, cgroup_add, cgroup_pids, own_cgroup

CGROUP_V2, CGROUP_V1, AFFINITY = "cgroup-v2", "cgroup-v1", "affinity"
PERIOD_US = 100_000
"""The bandwidth period: a process with ``cpus`` c runs at most c x 100 ms of CPU time in each 100 ms."""


@dataclass
class CpuLimit:
    """One process's limit: the cgroup it joins before it runs anything (the cgroup mechanisms), or the CPUs
    it is pinned to (affinity)."""

    name: str
    cpus: float
    mechanism: str
    cgroup: Path | None = None
    pinned: tuple[int, ...] = ()
    own_cgroup: bool = True
    """Whether the cgroup was made for this limit (and is removed with it)."""

    def describe(self) -> str:
        where = f" on CPUs {','.join(map(str, self.pinned))}" if self.pinned else ""
        return f"{self.cpus:g} CPU(s) by {self.mechanism}{where}"

    def apply(self, pid: int) -> None:
        """Hold ``pid`` to the limit: into the cgroup (a no-op for a process that joined it as it started), or
        every thread of it pinned (a thread it starts later inherits the mask)."""
        if self.cgroup is not None:
            cgroup_add(self.cgroup, pid)
            return
        try:
            threads = [int(task) for task in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return
        for thread in threads:
            try:
                os.sched_setaffinity(thread, self.pinned)
            except OSError:
                pass  # gone meanwhile

    def close(self) -> None:
        if self.cgroup is not None and self.own_cgroup and not cgroup_pids(self.cgroup):
            try:
                self.cgroup.rmdir()
            except OSError:
                pass  # a process is not gone yet: the node's reap removes it later


@dataclass
class CpuLimiter:
    """Makes the CPU limits of one agent: the first mechanism this host allows, chosen once and kept."""

    cpus_allowed: tuple[int, ...] = field(default_factory=lambda: tuple(sorted(os.sched_getaffinity(0))))
    mechanism: str | None = None
    refusals: list[str] = field(default_factory=list)
    """Why each cgroup mechanism was not used."""
    warned: bool = False
    """Whether the fallback to pinning was said (once per agent)."""
    _pinned: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def limit(self, name: str, cpus: float, memory_cgroup: Path | None = None, v2: bool = False) -> CpuLimit:
        """The limit of process ``name``; ``memory_cgroup``/``v2``: the cgroup of its memory limit, which a v2
        CPU limit must share."""
        if self.mechanism in (None, CGROUP_V2) and v2 and memory_cgroup is not None:
            _enable_cpu(memory_cgroup.parent)
            made = self._try(name, cpus, CGROUP_V2, memory_cgroup, own=False)
            if made is not None:
                return made
        for mechanism, parent_of, missing in (
                (CGROUP_V2, _v2_parent, "no cpu controller for this process's children"),
                (CGROUP_V1, _v1_parent, "no cpu controller mounted for this process")):
            if self.mechanism not in (None, mechanism) or (mechanism == CGROUP_V2 and memory_cgroup is not None):
                continue
            parent = parent_of()
            made = self._try(name, cpus, mechanism, parent / _group(name), own=True) if parent else None
            if made is not None:
                return made
            if parent is None:
                self.refusals.append(f"{mechanism}: {missing}")
        self.mechanism = self.mechanism or AFFINITY
        pinned = self._least_used(math.ceil(cpus))
        self._pinned[name] = pinned
        return CpuLimit(name, cpus, AFFINITY, pinned=pinned)

    def release(self, limit: CpuLimit) -> None:
        self._pinned.pop(limit.name, None)
        limit.close()

    def _try(self, name: str, cpus: float, mechanism: str, path: Path, own: bool) -> CpuLimit | None:
        try:
            if own:
                path.mkdir(exist_ok=True)
            quota = max(1000, round(cpus * PERIOD_US))
            if mechanism == CGROUP_V2:
                (path / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")
            else:
                (path / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
                (path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        except OSError as exc:
            self.refusals.append(f"{mechanism}: {path}: {exc.strerror or exc}")
            if own:
                try:
                    path.rmdir()
                except OSError:
                    pass
            return None
        self.mechanism = mechanism
        return CpuLimit(name, cpus, mechanism, cgroup=path, own_cgroup=own)

    def _least_used(self, count: int) -> tuple[int, ...]:
        uses = {cpu: 0 for cpu in self.cpus_allowed}
        for pinned in self._pinned.values():
            for cpu in pinned:
                uses[cpu] = uses.get(cpu, 0) + 1
        return tuple(sorted(sorted(uses, key=lambda cpu: (uses[cpu], cpu))[: max(1, count)]))


def _group(name: str) -> str:
    return "convoy-cpu-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _v2_parent() -> Path | None:
    """The v2 cgroup whose children get the cpu controller: the agent's own, else its parent."""
    own = own_cgroup(None)
    for mount in (CGROUP_ROOT / "unified", CGROUP_ROOT):
        if own is None or not (mount / "cgroup.controllers").is_file():
            continue
        here = mount / own.lstrip("/")
        for parent in (here, here.parent) if here != mount else (here,):
            if _enable_cpu(parent):
                return parent
    return None


def _enable_cpu(parent: Path) -> bool:
    """Whether ``parent``'s children get the v2 cpu controller (enabled here if it was not); never where the
    controller is not the cgroup's to give (a hybrid host keeps it in v1)."""
    if "cpu" not in _words(parent / "cgroup.controllers"):
        return False
    if "cpu" in _words(parent / "cgroup.subtree_control"):
        return True
    try:
        (parent / "cgroup.subtree_control").write_text("+cpu\n")
        return True
    except OSError:
        return False


def _v1_parent() -> Path | None:
    path = own_cgroup("cpu")
    for mount in (CGROUP_ROOT / "cpu", CGROUP_ROOT / "cpu,cpuacct"):
        if path is not None and (mount / "cpu.cfs_quota_us").is_file():
            return mount / path.lstrip("/")
    return None


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []
