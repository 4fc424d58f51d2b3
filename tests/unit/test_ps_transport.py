"""The parameter-server wire on real loopback sockets, in one process: tensors of every kind arrive intact, a
server's ConfigError reaches the worker as a ConfigError, a vanished server is a TransportError, and a client
at staleness 0 always pulls what it pushed. Servers and clients share one job's credentials (``JOB``); what a
stranger gets is tests/unit/test_role_transport.py's."""

from __future__ import annotations

import threading

import pytest
import torch

from convoy.errors import ConfigError
from convoy.parallel.ps.client import PSClient
from convoy.parallel.ps.optimizers import OptimizerSpec
from convoy.parallel.ps.placement import DenseSpec, TableSpec, place
from convoy.parallel.ps.service import ServerProcess
from convoy.parallel.transport import Connection, Credentials, Identity, Listener, Message, TransportError

JOB = Credentials.fresh(Identity("worker", 0, 0))


def serve() -> ServerProcess:
    return ServerProcess(credentials=JOB.as_process(Identity("ps", 0, 0)))


def echo(message: Message, caller: Identity) -> Message:
    if message.op == "bad":
        raise ConfigError("no such thing; do the other thing")
    return Message("echo", message.meta, message.tensors)


def test_tensors_of_every_kind_cross_intact() -> None:
    listener = Listener(echo, credentials=JOB)
    connection = Connection(listener.address, credentials=JOB)
    tensors = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16), "i64": torch.arange(7),
               "empty": torch.empty(0, 8), "scalar": torch.tensor(2.5), "strided": torch.randn(4, 6)[:, ::2],
               "bool": torch.tensor([True, False]), "big": torch.randn(300_000)}
    reply = connection.request(Message("hello", {"step": 3, "name": "w0"}, tensors))
    assert reply.op == "echo" and reply.meta == {"step": 3, "name": "w0"}
    assert set(reply.tensors) == set(tensors)
    for name, tensor in tensors.items():
        assert reply.tensors[name].dtype == tensor.dtype and torch.equal(reply.tensors[name], tensor), name
    with pytest.raises(ConfigError, match="no such thing; do the other thing"):
        connection.request(Message("bad"))
    assert connection.request(Message("again")).op == "echo"  # the connection survives an error reply
    connection.close()
    listener.close()
    with pytest.raises(TransportError, match="cannot reach the role service"):
        Connection(listener.address, timeout=2.0, credentials=JOB)


def test_a_client_at_staleness_0_pulls_every_push_it_made() -> None:
    servers = [serve() for _ in range(2)]
    placement = place([DenseSpec("w", (3,)), DenseSpec("v", (2, 2))], [TableSpec("emb", 9, 2)], 2)
    client = PSClient(placement, [server.address for server in servers], "w0", staleness=0, credentials=JOB)
    client.setup(OptimizerSpec("sgd", 1.0), {"w": torch.zeros(3), "v": torch.zeros(2, 2)},
                 {"emb": torch.zeros(9, 2)})
    for step in range(1, 6):
        client.push({"w": torch.ones(3), "v": torch.ones(2, 2)}, {"emb": (torch.tensor([4, 4, 7]), torch.ones(3, 2))})
        pulled = client.pull({"emb": torch.tensor([[7, 4], [0, 4]])})
        assert pulled.pushed == pulled.applied == [step, step] and pulled.versions == [step, step]
        assert torch.equal(pulled.dense["w"], torch.full((3,), -float(step)))
        assert pulled.ids["emb"].tolist() == [0, 4, 7]
        assert pulled.rows["emb"].tolist() == [[0.0, 0.0], [-2.0 * step] * 2, [-1.0 * step] * 2]
    client.shutdown_servers()
    client.close()
    assert all(server.wait(5.0) for server in servers)
    with pytest.raises(ConfigError, match="2 parameter servers but 1 addresses"):
        PSClient(placement, [servers[0].address], "w0", credentials=JOB)


def test_tagged_pushes_cross_and_each_server_counts_them() -> None:
    servers = [serve() for _ in range(2)]
    placement = place([DenseSpec("w", (3,))], [TableSpec("emb", 9, 2)], 2)
    client = PSClient(placement, [server.address for server in servers], "w0", credentials=JOB)
    client.setup(OptimizerSpec("sgd", 1.0), {"w": torch.zeros(3)}, {"emb": torch.zeros(9, 2)})
    for tag in (2, 0, 2, 1, 3):
        client.push({"w": torch.ones(3)}, {"emb": (torch.tensor([4, 7]), torch.ones(2, 2))}, tag=tag)
    client.flush()
    tallies = client.tally()
    assert [(t.tags, t.duplicates, t.version) for t in tallies] == [([0, 1, 2, 3], 1, 4)] * 2
    assert tallies[0].exactly_once(5) == ([4], []) and tallies[0].exactly_once(3) == ([], [3])
    assert torch.equal(client.pull({"emb": torch.tensor([4])}).dense["w"], torch.full((3,), -4.0))
    client.close()
    again = PSClient(placement, [server.address for server in servers], "w0", credentials=JOB)  # the rank started again
    assert again.pushed_to == [5, 5], "it goes on from its predecessor's count"
    again.push({"w": torch.ones(3)}, {"emb": (torch.tensor([4]), torch.ones(1, 2))}, tag=4)
    assert again.pull({"emb": torch.tensor([4])}).applied == [6, 6]
    client = again
    client.shutdown_servers()
    client.close()
    assert all(server.wait(5.0) for server in servers)


def test_a_worker_waits_only_when_more_than_s_pushes_ahead() -> None:
    """Server 0's pushes are held up (its push link is kept busy); at staleness 1 the first pull still returns,
    the second waits until the held pushes are applied."""
    servers = [serve() for _ in range(2)]
    placement = place([DenseSpec("w", (2,))], [TableSpec("emb", 4, 2)], 2)
    client = PSClient(placement, [server.address for server in servers], "w0", staleness=1, credentials=JOB)
    client.setup(OptimizerSpec("sgd", 1.0), {"w": torch.zeros(2)}, {"emb": torch.zeros(4, 2)})
    slow_link = client.pushers[0].connection.lock
    slow_link.acquire()
    client.push({"w": torch.ones(2)}, {"emb": (torch.tensor([0]), torch.ones(1, 2))})
    first = client.pull({"emb": torch.tensor([0])})
    assert first.pushed == [1, 1] and first.applied[0] == 0  # one push ahead: allowed at s = 1
    client.push({"w": torch.ones(2)}, {"emb": (torch.tensor([0]), torch.ones(1, 2))})
    got = []
    waiting = threading.Thread(target=lambda: got.append(client.pull({"emb": torch.tensor([0])})))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and not got  # two pushes ahead of server 0: the pull waits
    slow_link.release()
    waiting.join(10.0)
    assert got and got[0].pushed == [2, 2] and got[0].applied[0] >= 1
    client.shutdown_servers()
    client.close()
    assert all(server.wait(5.0) for server in servers)
