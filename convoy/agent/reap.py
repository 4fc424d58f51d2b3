"""What a node's workers leave behind, found and killed even after the agent that started them died.

Workers die with their agent (PDEATHSIG), but what they forked does not: a ``sleep 300`` started by
a worker is re-parented to pid 1 when the agent is SIGKILLed. Two nets catch it. Where a cgroup
hierarchy is writable, the agent puts its workers in a cgroup of their own, named after the job
and the node, so everything they start stays inside it and one write (``cgroup.kill``) or a sweep
of ``cgroup.procs`` ends it all. Everywhere, each worker's descendants carry the job id and the
node id in their environment (``CONVOY_JOB_ID``, ``CONVOY_NODE_ID``), so a scan of ``/proc``
finds them. The launcher reaps a node when its agent exits, and an agent reaps its node when it
joins a job and when it exits. Torch-free, no third-party imports.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
REAP_WAIT_S = 2.0


def _cgroup_name(job_id: str, node_id: str) -> str:
    return "convoy-" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{job_id}-{node_id}")


def own_cgroup(controller: str | None) -> str | None:
    """This process's cgroup path in the v2 hierarchy (``controller`` None) or a v1 controller's."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (controller is None and controllers == "") or (controller and controller in controllers.split(",")):
            return path
    return None


def _hierarchies() -> list[tuple[Path, bool]]:
    """Where a node cgroup may go: (the directory to create it in, whether it is cgroup v2)."""
    found: list[tuple[Path, bool]] = []
    v2_path = own_cgroup(None)
    for mount in (CGROUP_ROOT / "unified", CGROUP_ROOT):
        if v2_path is not None and (mount / "cgroup.controllers").is_file():
            found.append((mount / v2_path.lstrip("/"), True))
            break
    v1_path = own_cgroup("pids")
    if v1_path is not None and (CGROUP_ROOT / "pids" / "cgroup.procs").is_file():
        found.append((CGROUP_ROOT / "pids" / v1_path.lstrip("/"), False))
    return found


def cgroup_add(path: Path, pid: int) -> bool:
    """Move a process into the cgroup at ``path`` (v1 or v2); False if it is gone or the kernel refuses."""
    try:
        (path / "cgroup.procs").write_text(f"{pid}\n")
        return True
    except OSError:
        return False


def cgroup_pids(path: Path) -> list[int]:
    """The processes in the cgroup at ``path`` (none if it is gone)."""
    try:
        return [int(line) for line in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


class NodeCgroup:
    """A cgroup holding one node's workers and everything they start."""

    def __init__(self, path: Path, v2: bool) -> None:
        self.path, self.v2 = path, v2

    @classmethod
    def create(cls, job_id: str, node_id: str) -> NodeCgroup | None:
        """Make (or reuse) the node's cgroup; None where no hierarchy is writable."""
        for parent, v2 in _hierarchies():
            path = parent / _cgroup_name(job_id, node_id)
            try:
                path.mkdir(exist_ok=True)
                (path / "cgroup.procs").stat()
            except OSError:
                continue
            return cls(path, v2)
        return None

    @classmethod
    def existing(cls, job_id: str, node_id: str) -> list[NodeCgroup]:
        return [cls(parent / _cgroup_name(job_id, node_id), v2) for parent, v2 in _hierarchies()
                if (parent / _cgroup_name(job_id, node_id)).is_dir()]

    def add(self, pid: int) -> bool:
        """Move a process in; False if it is gone or the kernel refuses."""
        return cgroup_add(self.path, pid)

    def pids(self) -> list[int]:
        return cgroup_pids(self.path)

    def kill(self) -> int:
        """SIGKILL everything inside; returns how many processes were there."""
        inside = self.pids()
        if self.v2 and inside:
            try:
                (self.path / "cgroup.kill").write_text("1\n")
            except OSError:
                pass
        for pid in inside:
            _kill(pid)
        return len(inside)

    def remove(self) -> None:
        """Kill what is inside and remove the cgroup (it can only go once empty)."""
        deadline = time.monotonic() + REAP_WAIT_S
        while self.kill() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            self.path.rmdir()
        except OSError:
            pass  # gone already, or a process is not dead yet: the next reap tries again


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tagged_processes(job_id: str, node_id: str) -> list[int]:
    """Processes started with this job's and node's worker environment (a worker's descendants)."""
    wanted = (f"CONVOY_JOB_ID={job_id}".encode(), f"CONVOY_NODE_ID={node_id}".encode())
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                variables = handle.read().split(b"\0")
        except OSError:
            continue
        if all(variable in variables for variable in wanted):
            found.append(int(entry.name))
    return found


def reap(job_id: str, node_id: str, spare: frozenset[int] = frozenset()) -> int:
    """Kill whatever a node's workers of this job left running; returns how many were found. ``spare``: processes
    of the caller's own that carry the tags (a fork server started before the first join)."""
    if not job_id:
        return 0
    found: set[int] = set()
    for cgroup in NodeCgroup.existing(job_id, node_id):
        found.update(cgroup.pids())
        cgroup.remove()
    deadline = time.monotonic() + REAP_WAIT_S
    while (left := [pid for pid in tagged_processes(job_id, node_id) if pid not in spare]) and \
            time.monotonic() < deadline:
        found.update(left)
        for pid in left:
            _kill(pid)
        time.sleep(0.01)
    return len(found)
