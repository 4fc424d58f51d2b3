"""Two agents in their own network namespaces: cut one's link, the job shrinks; restore it, it grows back."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from helpers import ProcessScope, fixture, wait_for
from convoy.control.store import read_status
from convoy.testing.netns import HostNetwork, netns_problem

pytestmark = pytest.mark.slow
MASTER_PORT = 29400


@pytest.fixture
def network() -> Iterator[HostNetwork]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    problem = netns_problem()
    if problem:
        pytest.skip(f"network namespaces are not permitted here: {problem}")
    with HostNetwork(2) as net:
        yield net


def _in(net: HostNetwork, host: int | None) -> list[str]:
    return [*net.exec_prefix(host), sys.executable, "-m", "convoy"]


def _rounds(run_dir: Path) -> list[tuple[str, str, float]]:
    events = read_status(run_dir, recent=1000)["events"]
    return [(e["kind"], e["message"], e["ts"]) for e in events if e["kind"] in ("regroup", "round_closed")]


def test_cut_link_shrinks_the_job_and_restored_link_grows_it(procs: ProcessScope, network: HostNetwork,
                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    master = procs.start(["master", "--host", network.address(1), "--port", MASTER_PORT, "--nnodes", "1:2",
                          "--heartbeat-timeout", 2, "--rdzv-wait", 30, "--max-restarts", 5, "--run-dir", run_dir],
                         command=_in(network, None))
    master.wait_output(r"token file")
    for index in range(2):
        procs.start(["agent", "--master", f"{network.address(1)}:{MASTER_PORT}", "--token-file", run_dir / "token",
                     "--node-id", f"ns{index}", "--preload", "", fixture("worker.py"), "--hold", 8],
                    command=_in(network, index))
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


RECEIVE = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
conn, _ = server.accept()
total = 0
while chunk := conn.recv(1 << 16):
    total += len(chunk)
print(total, flush=True)
"""
SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as conn:
    conn.sendall(b"x" * int(sys.argv[3]))
"""


def test_shaped_link_carries_and_counts_what_leaves_a_host(procs: ProcessScope, network: HostNetwork) -> None:
    applied = network.shape(0, "50mbit", "1ms")
    assert applied.startswith(("netem", "tbf")) and "50mbit" in applied
    receiver = procs.start(["-c", RECEIVE, network.host_address(1), 29500],
                           command=[*network.exec_prefix(1), sys.executable])
    receiver.wait_output("listening")
    before = network.sent_bytes(0)
    sent = procs.run(["-c", SEND, network.host_address(1), 29500, 2_000_000],
                     command=[*network.exec_prefix(0), sys.executable])
    assert sent.returncode == 0, sent.explain()
    result = receiver.wait(30)
    assert result.returncode == 0 and result.stdout.split()[-1] == "2000000", result.explain()
    assert network.sent_bytes(0) - before >= 2_000_000, "the host's link counter missed what it sent"
