"""A role service (a real parameter server, in a thread, on loopback sockets) against a stranger and against bad
input: a caller without the job's secret, with a wrong one, with a header of 2^40 bytes or a tensor past the
bounds, with a save or restore path outside the run dir. Each is refused in one reply naming why, its connection
is closed, nothing is written or allocated for it, and the job's own worker goes on pulling and pushing."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from convoy.errors import ConfigError
from convoy.parallel.ps.client import PSClient
from convoy.parallel.ps.optimizers import OptimizerSpec
from convoy.parallel.ps.placement import DenseSpec, TableSpec, place
from convoy.parallel.ps.service import ServerProcess
from convoy.parallel.transport import (BadMessage, Connection, Credentials, Identity, Limits, Message, OutsideRunDir,
                                       Refused)
from convoy.parallel.transport.wire import recv_message, send_message
from convoy.worker.role_env import service_env, service_secret

JOB = Credentials.fresh(Identity("worker", 0, 0))
TERABYTE = 1 << 40


@dataclass
class Job:
    server: ServerProcess
    client: PSClient
    run_dir: Path

    def still_serves(self) -> None:
        """The job's worker pushes and pulls on, on the connections it had before."""
        before = self.client.pull({"emb": torch.tensor([1])}).versions[0]
        self.client.push({"w": torch.ones(3)}, {"emb": (torch.tensor([1]), torch.ones(1, 2))})
        assert self.client.pull({"emb": torch.tensor([1])}).versions == [before + 1]


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    server = ServerProcess(credentials=JOB.as_process(Identity("ps", 0, 0)), run_dir=run_dir)
    client = PSClient(place([DenseSpec("w", (3,))], [TableSpec("emb", 8, 2)], 1), [server.address], "worker0",
                      credentials=JOB)
    client.setup(OptimizerSpec("sgd", 0.1), {"w": torch.zeros(3)}, {"emb": torch.zeros(8, 2)})
    yield Job(server, client, run_dir)
    client.shutdown_servers()
    client.close()
    assert server.wait(10)


def frame(op: str, meta: dict, tensors: list | None = None, sizes: tuple[int, ...] = ()) -> bytes:
    """One message as bytes, as anyone could write it: the header's length, the header, the tensors' sizes."""
    header = json.dumps({"op": op, "meta": meta, "tensors": tensors or []}).encode()
    return struct.pack("!Q", len(header)) + header + struct.pack(f"!{len(sizes)}Q", *sizes)


def stranger(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10)


def refusal_then_close(sock: socket.socket) -> str:
    """The one reply (an error naming why), then the end of the connection."""
    reply = recv_message(sock, Limits())
    assert reply.op == "error" and reply.meta["kind"] in ("Refused", "BadMessage", "OutsideRunDir"), reply
    assert sock.recv(1) == b"", "the service closes the connection after its refusal"
    sock.close()
    return reply.meta["message"]


def test_a_caller_without_the_secret_is_refused_before_any_op_runs(job: Job) -> None:
    for op, meta in (("save", {"path": str(job.run_dir / "stolen.pt")}), ("shutdown", {}),
                     ("status", {"worker": "worker0"})):
        sock = stranger(job.server.address)
        sock.sendall(frame(op, meta))
        why = refusal_then_close(sock)
        assert "starts with the transport's handshake" in why and "CONVOY_ROLE_SECRET" in why, why
    assert not (job.run_dir / "stolen.pt").exists() and not job.server.stopped.is_set()
    with pytest.raises(ConfigError, match="CONVOY_ROLE_SECRET is not set: a role service and its callers are"):
        Connection(job.server.address)  # this test process is no process of a job: it has no secret
    job.still_serves()


def test_a_caller_with_a_wrong_secret_is_refused_by_name(job: Job) -> None:
    with pytest.raises(Refused, match=r"refused this process: worker 0 \(incarnation 0\) did not prove it holds this "
                                      r"job's secret"):
        Connection(job.server.address, credentials=Credentials.fresh(Identity("worker", 0, 0)))
    assert job.server.listener.refused == 1
    job.still_serves()


def test_a_service_that_cannot_prove_the_secret_is_not_used(job: Job) -> None:
    """The other way round: a caller with the job's secret meets a service of another job on the address."""
    other = ServerProcess(credentials=Credentials.fresh(Identity("ps", 0, 0)))
    try:
        with pytest.raises(Refused, match="did not prove it holds this job's secret"):
            Connection(other.address, credentials=JOB)
    finally:
        other.listener.close()


def test_a_header_of_2_to_the_40_bytes_is_refused_before_and_after_the_handshake(job: Job) -> None:
    sock = stranger(job.server.address)
    sock.sendall(struct.pack("!Q", TERABYTE))
    assert f"a message header of {TERABYTE} bytes is over this service's bound of 4096" in refusal_then_close(sock)
    member = Connection(job.server.address, credentials=JOB)  # the job's own process, gone wrong
    member.sock.sendall(struct.pack("!Q", TERABYTE))
    assert f"header of {TERABYTE} bytes is over this service's bound of {16 << 20}" in refusal_then_close(member.sock)
    job.still_serves()


def test_tensors_past_the_bounds_are_refused_before_they_are_allocated(job: Job) -> None:
    cases = [
        ([["ids/emb", "torch.uint8", [TERABYTE]]], (TERABYTE,), f"a message of {TERABYTE} tensor bytes is over"),
        ([["ids/emb", "torch.int64", [4]]], (TERABYTE,),
         f"announced as {TERABYTE} bytes but a torch.int64 of shape [4] is 32"),
        ([["ids/emb", "torch.complex128", [4]]], (64,), "is not [name, dtype, shape]"),
        ([["a", "torch.uint8", [1]], ["a", "torch.uint8", [1]]], (1, 1), "names one tensor twice"),
    ]
    for tensors, sizes, why in cases:
        member = Connection(job.server.address, credentials=JOB)
        member.sock.sendall(frame("push", {"worker": "worker0"}, tensors, sizes))
        assert why in refusal_then_close(member.sock), why
    small = ServerProcess(credentials=JOB.as_process(Identity("ps", 1, 0)), limits=Limits(message_bytes=1 << 20))
    member = Connection(small.address, credentials=JOB)
    with pytest.raises(BadMessage, match=f"a message of {2 << 20} tensor bytes is over this service's bound of "
                                         f"{1 << 20}"):
        member.request(Message("push", {"worker": "worker0"}, {"dense/w": torch.zeros(2 << 20, dtype=torch.uint8)}))
    small.listener.close()
    job.still_serves()


@pytest.mark.parametrize("where", ["outside", "climbing", "link", "token", "the run dir"])
def test_save_and_restore_paths_outside_the_run_dir_are_refused(job: Job, tmp_path: Path, where: str) -> None:
    (job.run_dir / "out").symlink_to(tmp_path)
    (job.run_dir / "token").write_text("the job's token\n")
    requested = {"outside": str(tmp_path / "x.pt"), "climbing": "../x.pt", "link": "out/x.pt", "token": "token",
                 "the run dir": str(job.run_dir)}[where]
    for op in ("save", "restore"):
        member = Connection(job.server.address, credentials=JOB)
        member.sock.sendall(frame(op, {"path": requested}))
        why = refusal_then_close(member.sock)
        assert re.fullmatch(f"{re.escape(repr(requested))} (is outside the job's run dir|does not end in '.pt').*",
                            why), why
    with pytest.raises(OutsideRunDir, match=f"role service at .* refused this process: {re.escape(repr(requested))}"):
        Connection(job.server.address, credentials=JOB).request(Message("save", {"path": requested}))
    assert not (tmp_path / "x.pt").exists() and (job.run_dir / "token").read_text() == "the job's token\n"
    job.still_serves()


def test_save_and_restore_inside_the_run_dir_work(job: Job) -> None:
    member = Connection(job.server.address, credentials=JOB)
    member.request(Message("save", {"path": "shards/ps-0.pt"}))  # relative: from the run dir
    assert (job.run_dir / "shards" / "ps-0.pt").is_file()
    assert member.request(Message("restore", {"path": str(job.run_dir / "shards" / "ps-0.pt")})).op == "ok"
    member.close()
    job.still_serves()


def test_a_malformed_request_of_a_member_is_an_error_reply_and_the_connection_goes_on(job: Job) -> None:
    member = Connection(job.server.address, credentials=JOB)
    with pytest.raises(ConfigError, match=r"op 'pull': malformed request \(KeyError"):
        member.request(Message("pull", {}))
    assert member.request(Message("status", {"worker": "worker0"})).meta["ready"] is True
    member.close()


def test_the_role_env_secret_reaches_both_sides(job: Job) -> None:
    """Credentials.from_env: the key the agent derives from the job's token, and the process's role."""
    env = {**service_env("the-job-token", "127.0.0.1", tls=False), "ROLE_NAME": "worker", "ROLE_RANK": "1",
           "ROLE_WORLD_SIZE": "2", "CONVOY_ROLE_INCARNATION": "4"}
    credentials = Credentials.from_env(env)
    assert credentials.secret == bytes.fromhex(service_secret("the-job-token")) != b"the-job-token"
    assert credentials.identity == Identity("worker", 1, 4) and not credentials.tls
    assert "the-job-token" not in json.dumps(env) and os.environ.get("CONVOY_ROLE_SECRET") is None
    assert service_secret("the-job-token") != service_secret("another-job-token")
    assert "CONVOY_ROLE_SECRET" not in service_env("", "127.0.0.1", tls=False)


def test_a_reply_is_received_into_the_callers_tensors_where_they_fit() -> None:
    """``into``: a tensor of the same name, dtype and size is filled in place (its pages faulted in once, whatever
    the number of replies); one that does not fit is left alone and a tensor of its own is made."""
    sent = Message("weights", {}, {"fits": torch.arange(12, dtype=torch.float32).view(3, 4),
                                   "other_dtype": torch.ones(4, dtype=torch.float64), "other_size": torch.ones(5)})
    given = {"fits": torch.zeros(12), "other_dtype": torch.zeros(4), "other_size": torch.zeros(4)}
    ours, theirs = socket.socketpair()
    with ours, theirs:
        send_message(theirs, sent)
        got = recv_message(ours, Limits(), into=given)
    assert got.tensors["fits"].data_ptr() == given["fits"].data_ptr() and got.tensors["fits"].shape == (3, 4)
    assert torch.equal(given["fits"], torch.arange(12, dtype=torch.float32))
    for name in ("other_dtype", "other_size"):
        assert got.tensors[name].data_ptr() != given[name].data_ptr() and torch.equal(got.tensors[name],
                                                                                      sent.tensors[name])
        assert not given[name].any(), f"{name}: the caller's tensor that does not fit is not written"
