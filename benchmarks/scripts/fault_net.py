"""Two "hosts" for the link-cut fault: the master and each agent in its own network namespace.

``convoy.testing.netns.HostNetwork``: the master runs in the hub namespace beside the bridge,
each agent in a host namespace; cutting an agent's link sets its bridge end down. Each agent
also gets its own /dev/shm (a tmpfs in the mount namespace ``ip netns exec`` creates), as on a
separate host, so snapshots are not shared.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
from fault_job import Job, read_state

from convoy.testing.netns import HostNetwork, netns_problem

__all__ = ["NetJob", "netns_problem"]

MASTER_PORT = 29400
PRIVATE_SHM = 'mount -t tmpfs -o size=512m convoy-faults-shm /dev/shm && exec "$0" "$@"'


class NetJob(Job):
    """``convoy master`` and two ``convoy agent``s, each in its own namespace; the master's exit is the job's."""

    def __init__(self, tmp: Path, sleep_s: float, seed: int, heartbeat_timeout_s: float) -> None:
        super().__init__(tmp, nodes=2)
        self.net = HostNetwork(2, prefix="cf", second_octet=79)
        self.agent_procs: list[subprocess.Popen[bytes]] = []
        try:
            self._start(sleep_s, seed, heartbeat_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, sleep_s: float, seed: int, heartbeat_timeout_s: float) -> None:
        python = [sys.executable, "-m", "convoy"]
        master_ns = self.net.exec_prefix(None)
        self.main = self.spawn([*master_ns, *python, "master", "--host", self.net.address(1), "--port",
                                str(MASTER_PORT), "--nnodes", "1:2", "--heartbeat-timeout", str(heartbeat_timeout_s),
                                "--rdzv-wait", "30", "--max-restarts", "5", "--run-dir", str(self.run_dir)])
        deadline = time.monotonic() + 30
        while not (self.run_dir / "token").exists() or read_state(self.run_dir) is None:
            if time.monotonic() > deadline or self.main.poll() is not None:
                raise RuntimeError(f"the namespaced master did not start: {self.last_error()}")
            time.sleep(0.05)
        for index in range(2):
            agent_ns = [*self.net.exec_prefix(index), "sh", "-c", PRIVATE_SHM]
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
