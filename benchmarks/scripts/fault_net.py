"""Two "hosts" for the link-cut fault: the master and each agent in its own network namespace.

A bridge in the master's namespace joins one veth pair per agent; cutting an agent's link
sets its bridge end down. Each agent also gets its own /dev/shm (a tmpfs in the mount
namespace ``ip netns exec`` creates), as on a separate host, so snapshots are not shared.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
from fault_job import Job, read_state

SUBNET = "10.79.{}.{}"
MASTER_PORT = 29400
PRIVATE_SHM = 'mount -t tmpfs -o size=512m convoy-faults-shm /dev/shm && exec "$0" "$@"'


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def netns_problem() -> str | None:
    """Why network namespaces cannot be used here, or None if they can."""
    probe = f"cfprobe{uuid.uuid4().hex[:6]}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run 'ip netns add': {exc}"
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.decode(errors='replace').strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True, timeout=10)
    return None


class Network:
    """A bridge in the master's namespace and one namespace per agent, each joined by a veth pair."""

    def __init__(self, agents: int) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.subnet = int(self.tag[:2], 16) % 200 + 20
        self.master_ns = f"cfm{self.tag}"
        self.spaces: list[str] = []
        try:
            self._build(agents)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self.remove()
            raise

    def address(self, host: int) -> str:
        return SUBNET.format(self.subnet, host)

    def _build(self, agents: int) -> None:
        _ip("netns", "add", self.master_ns)
        self.spaces.append(self.master_ns)
        _ip("-n", self.master_ns, "link", "set", "lo", "up")
        _ip("-n", self.master_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.master_ns, "addr", "add", f"{self.address(1)}/24", "dev", "br0")
        _ip("-n", self.master_ns, "link", "set", "br0", "up")
        for index in range(agents):
            space, inner, outer = f"cfa{index}{self.tag}", self.agent_link(index), f"b{index}{self.tag}"
            _ip("netns", "add", space)
            self.spaces.append(space)
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", space)
            _ip("link", "set", outer, "netns", self.master_ns)
            _ip("-n", self.master_ns, "link", "set", outer, "master", "br0")
            _ip("-n", self.master_ns, "link", "set", outer, "up")
            _ip("-n", space, "addr", "add", f"{self.address(index + 2)}/24", "dev", inner)
            _ip("-n", space, "link", "set", inner, "up")
            _ip("-n", space, "link", "set", "lo", "up")

    def agent_ns(self, index: int) -> str:
        return self.spaces[index + 1]

    def agent_link(self, index: int) -> str:
        """The agent's end of its veth pair, inside its namespace."""
        return f"e{index}{self.tag}"

    def set_link(self, index: int, up: bool) -> None:
        _ip("-n", self.master_ns, "link", "set", f"b{index}{self.tag}", "up" if up else "down")

    def remove(self) -> None:
        """Delete the namespaces (their veth pairs and the bridge go with them)."""
        for space in self.spaces:
            subprocess.run(["ip", "netns", "del", space], check=False, capture_output=True, timeout=10)
        self.spaces = []


class NetJob(Job):
    """``convoy master`` and two ``convoy agent``s, each in its own namespace; the master's exit is the job's."""

    def __init__(self, tmp: Path, sleep_s: float, seed: int, heartbeat_timeout_s: float) -> None:
        super().__init__(tmp, nodes=2)
        self.net = Network(agents=2)
        self.agent_procs: list[subprocess.Popen[bytes]] = []
        try:
            self._start(sleep_s, seed, heartbeat_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, sleep_s: float, seed: int, heartbeat_timeout_s: float) -> None:
        python = [sys.executable, "-m", "convoy"]
        master_ns = ["ip", "netns", "exec", self.net.master_ns]
        self.main = self.spawn([*master_ns, *python, "master", "--host", self.net.address(1), "--port",
                                str(MASTER_PORT), "--nnodes", "1:2", "--heartbeat-timeout", str(heartbeat_timeout_s),
                                "--rdzv-wait", "30", "--max-restarts", "5", "--run-dir", str(self.run_dir)])
        deadline = time.monotonic() + 30
        while not (self.run_dir / "token").exists() or read_state(self.run_dir) is None:
            if time.monotonic() > deadline or self.main.poll() is not None:
                raise RuntimeError(f"the namespaced master did not start: {self.last_error()}")
            time.sleep(0.05)
        for index in range(2):
            agent_ns = ["ip", "netns", "exec", self.net.agent_ns(index), "sh", "-c", PRIVATE_SHM]
            self.agent_procs.append(self.spawn([
                *agent_ns, *python, "agent", "--master", f"{self.net.address(1)}:{MASTER_PORT}", "--token-file",
                str(self.run_dir / "token"), "--run-dir", str(self.run_dir), "--node-id", f"ns{index}",
                "--nproc-per-node", "1", "--stop-grace", "2", *self.train_args(sleep_s, seed)]))

    def agents(self) -> list[psutil.Process]:
        return [self.known[p.pid] for p in self.agent_procs if p.poll() is None]

    def stop(self, grace_s: float = 10.0) -> None:
        try:
            for index in range(len(self.net.spaces) - 1):  # let a cut agent hear the end and exit on its own
                try:
                    self.net.set_link(index, up=True)
                except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
                    pass
            super().stop(grace_s)
        finally:
            self.net.remove()
