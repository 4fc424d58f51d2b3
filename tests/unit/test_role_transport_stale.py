"""A role service refuses a caller of an incarnation that has ended, on a new connection and on the one it opened
while it was current, as soon as the agent's addresses file says its rank was started again; its other callers
go on. A real parameter server in a thread, the agent's real file (``write_addresses``), loopback sockets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convoy.parallel.ps.client import PSClient
from convoy.parallel.ps.optimizers import OptimizerSpec
from convoy.parallel.ps.placement import DenseSpec, TableSpec, place
from convoy.parallel.ps.service import ServerProcess
from convoy.parallel.transport import Connection, Credentials, Identity, IncarnationFence, Message, StaleIncarnation
from convoy.worker.role_env import RoleInfo, role, write_addresses

JOB = Credentials.fresh(Identity("worker", 0, 0))
LAYOUT = place([DenseSpec("w", (3,))], [TableSpec("emb", 8, 2)], 1)


def publish(path: Path, version: int, workers: list[int]) -> None:
    """What the agent does when the master's addresses grow: the whole file replaced."""
    write_addresses(path, version, {"ps": ["127.0.0.1:1"], "worker": ["", ""]}, {"ps": [0], "worker": workers})


def push_once(client: PSClient) -> list[int]:
    client.push({"w": torch.ones(3)}, {"emb": (torch.tensor([1]), torch.ones(1, 2))})
    return client.pull({"emb": torch.tensor([1])}).versions


def test_a_stale_worker_is_refused_on_its_open_connection_and_on_a_new_one(tmp_path: Path) -> None:
    addresses = tmp_path / "roles" / "addresses-n0.json"
    publish(addresses, 1, [0, 0])
    fence = IncarnationFence(RoleInfo("ps", 0, 1, addresses_file=str(addresses)).refresh())
    server = ServerProcess(credentials=JOB.as_process(Identity("ps", 0, 0)), admit=fence.check)
    worker0 = PSClient(LAYOUT, [server.address], "worker0", credentials=JOB)
    worker0.setup(OptimizerSpec("sgd", 0.1), {"w": torch.zeros(3)}, {"emb": torch.zeros(8, 2)})
    stale = JOB.as_process(Identity("worker", 1, 0))
    worker1 = Connection(server.address, credentials=stale)
    assert worker1.request(Message("status", {"worker": "worker1"})).meta["ready"]
    assert push_once(worker0) == [1]

    publish(addresses, 2, [0, 1])  # worker 1 was started again: incarnation 0 has ended
    with pytest.raises(StaleIncarnation, match=r"refused this process: worker 1 \(incarnation 0\) has ended: worker 1 "
                                               r"runs as incarnation 1 now"):
        worker1.request(Message("push", {"worker": "worker1"}, {"dense/w": torch.ones(3)}))
    with pytest.raises(StaleIncarnation, match=r"worker 1 \(incarnation 0\) has ended"):
        Connection(server.address, credentials=stale)
    current = Connection(server.address, credentials=JOB.as_process(Identity("worker", 1, 1)))
    assert current.request(Message("status", {"worker": "worker1"})).meta["applied"] == 0, "no stale push landed"
    assert push_once(worker0) == [2], "worker 0 goes on, on the connections it had"
    newer = Connection(server.address, credentials=JOB.as_process(Identity("worker", 1, 2)))
    assert newer.request(Message("status", {"worker": "worker1"})).op == "ok", \
        "an incarnation newer than this node has heard of yet is served"
    for connection in (current, newer):
        connection.close()
    worker0.shutdown_servers()
    worker0.close()
    assert server.wait(10)


def test_the_fence_sees_each_new_version_of_the_file_at_once(tmp_path: Path) -> None:
    addresses = tmp_path / "addresses.json"
    fence = IncarnationFence(role({"ROLE_NAME": "ps", "CONVOY_ROLE_ADDRESSES_FILE": str(addresses)}))
    fence.check(Identity("worker", 0, 0))  # no file yet: nothing is known, nothing is refused
    for version in range(1, 6):  # replaced faster than the file clock ticks: the same size each time
        publish(addresses, version, [version, 0])
        with pytest.raises(StaleIncarnation, match=f"runs as incarnation {version} now"):
            fence.check(Identity("worker", 0, version - 1))
        fence.check(Identity("worker", 0, version))
    fence.check(Identity("learner", 5, 0))  # a role or rank the file does not list
    fence.check(Identity("worker", 7, 0))
    publish(addresses, 2, [9, 9])  # an older version than held (the master's versions only grow): not taken
    fence.check(Identity("worker", 0, 5))
    assert fence.info.addresses_version == 5
