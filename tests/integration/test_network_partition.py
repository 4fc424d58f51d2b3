"""Two agents in their own network namespaces: cut one's link, the job shrinks; restore it, it grows back."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from helpers import ProcessScope, fixture, wait_for
from convoy.control.store import read_status

pytestmark = pytest.mark.slow
SUBNET = "10.77.{}.{}"
MASTER_PORT = 29400


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Network:
    """A bridge in the master's namespace and one namespace per agent, each joined by a veth pair."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.subnet = int(self.tag[:2], 16) % 200 + 20
        self.master_ns = f"cvm{self.tag}"
        self.spaces: list[str] = []

    def address(self, host: int) -> str:
        return SUBNET.format(self.subnet, host)

    def build(self, agents: int) -> None:
        _ip("netns", "add", self.master_ns)
        self.spaces.append(self.master_ns)
        _ip("-n", self.master_ns, "link", "set", "lo", "up")
        _ip("-n", self.master_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.master_ns, "addr", "add", f"{self.address(1)}/24", "dev", "br0")
        _ip("-n", self.master_ns, "link", "set", "br0", "up")
        for index in range(agents):
            space, inner, outer = f"cva{index}{self.tag}", f"e{index}{self.tag}", f"b{index}{self.tag}"
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

    def set_link(self, index: int, up: bool) -> None:
        _ip("-n", self.master_ns, "link", "set", f"b{index}{self.tag}", "up" if up else "down")

    def remove(self) -> None:
        for space in self.spaces:
            subprocess.run(["ip", "netns", "del", space], capture_output=True, timeout=10)


@pytest.fixture
def network() -> Iterator[Network]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    probe = f"cvprobe{uuid.uuid4().hex[:6]}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        pytest.skip("'ip netns add' is not permitted here")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    net = Network()
    try:
        net.build(agents=2)
        yield net
    finally:
        net.remove()


def _in(space: str) -> list[str]:
    return ["ip", "netns", "exec", space, sys.executable, "-m", "convoy"]


def _rounds(run_dir: Path) -> list[tuple[str, str, float]]:
    events = read_status(run_dir, recent=1000)["events"]
    return [(e["kind"], e["message"], e["ts"]) for e in events if e["kind"] in ("regroup", "round_closed")]


def test_cut_link_shrinks_the_job_and_restored_link_grows_it(procs: ProcessScope, network: Network,
                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    master = procs.start(["master", "--host", network.address(1), "--port", MASTER_PORT, "--nnodes", "1:2",
                          "--heartbeat-timeout", 2, "--rdzv-wait", 30, "--max-restarts", 5, "--run-dir", run_dir],
                         command=_in(network.master_ns))
    master.wait_output(r"token file")
    for index in range(2):
        procs.start(["agent", "--master", f"{network.address(1)}:{MASTER_PORT}", "--token-file", run_dir / "token",
                     "--node-id", f"ns{index}", "--preload", "", fixture("worker.py"), "--hold", 8],
                    command=_in(network.agent_ns(index)))
    master.wait_output(r"round 1: 2 nodes, world size 2")
    cut_at = time.time()
    network.set_link(0, up=False)
    master.wait_output(r"node ns0 sent no heartbeat for 2 s: going on with 1 nodes", timeout=30)
    master.wait_output(r"round 2: 1 nodes, world size 1")
    lost = next(ts for kind, message, ts in _rounds(run_dir) if kind == "regroup" and "ns0" in message)
    assert lost - cut_at < 2 + 2.0, "the master should notice within the heartbeat timeout (plus a tick)"
    network.set_link(0, up=True)
    master.wait_output(r"node ns0 joins: growing to 2 nodes", timeout=40)
    master.wait_output(r"round 3: 2 nodes, world size 2")
    result = master.wait(60)
    assert result.returncode == 0, result.explain()
    assert "job succeeded" in result.stdout
    wait_for(lambda: not procs.leftovers(), 15, "agents to exit")
