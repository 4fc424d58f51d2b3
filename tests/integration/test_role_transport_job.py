"""The parameter servers of a running ``convoy run --ps 2 --workers 2`` job, reached from outside the job: they
listen on the node's address only; a stranger without the job's secret (asking to save the shard over a file of
its choice) and a caller with a wrong secret are refused by name and nothing is written; the job's owner, who
can read the job's token, derives the secret and is served; and the job trains on to its exactly-once end."""

from __future__ import annotations

import json
import re
import socket
import struct
from pathlib import Path

import psutil
import pytest
from helpers import REPO, ProcessScope, wait_for

from convoy.control.token import TOKEN_FILE, read_token
from convoy.parallel.transport import Connection, ConnectionLost, Credentials, Identity, Message, Refused
from convoy.parallel.transport.wire import Limits, recv_message
from convoy.worker.role_env import service_secret

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "train_ps.py")
STEPS = 40
ARGS = ["--steps", STEPS, "--batch", 64, "--rows", 2000, "--dim", 8, "--held-out", 1024, "--slow-worker", 0.05]


def serving_port(run_dir: Path) -> int | None:
    log = run_dir / "logs" / "roles" / "ps0.log"
    found = re.search(r"parameter server 0 serving on port (\d+)", log.read_text() if log.exists() else "")
    return int(found.group(1)) if found else None


def owner_status(address: str, owner: Credentials) -> dict | None:
    """PS 0's status once it holds its shard (the chief has set it up: the job is training); None before."""
    try:
        connection = Connection(address, timeout=5, credentials=owner)
    except ConnectionLost:
        return None
    try:
        meta = connection.request(Message("status", {"worker": "worker0"})).meta
    finally:
        connection.close()
    return meta if meta["ready"] else None


def stranger_asks(address: str, op: str, meta: dict) -> str:
    """Send one message as anyone on the network could (no handshake); the reply's message, once the PS closed."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        header = json.dumps({"op": op, "meta": meta, "tensors": []}).encode()
        sock.sendall(struct.pack("!Q", len(header)) + header)
        reply = recv_message(sock, Limits())
        assert reply.op == "error" and reply.meta["kind"] == "Refused", reply
        assert sock.recv(1) == b"", "the PS closed the stranger's connection"
    return reply.meta["message"]


def test_the_ps_of_a_running_job_serves_its_processes_only(procs: ProcessScope, run_dir: Path,
                                                           tmp_path: Path) -> None:
    job = procs.start(["run", "--ps", 2, "--workers", 2, "--run-dir", run_dir, EXAMPLE, *ARGS])
    port = wait_for(lambda: serving_port(run_dir), 90, "ps 0 to serve")
    address = f"127.0.0.1:{port}"
    owner = Credentials(bytes.fromhex(service_secret(read_token(run_dir / TOKEN_FILE))), Identity("owner", 0, 0))
    status = wait_for(lambda: owner_status(address, owner), 90, "ps 0 to hold its shard")

    listening = {c.laddr for c in psutil.Process(status["pid"]).net_connections("tcp") if c.status == "LISTEN"}
    assert listening == {("127.0.0.1", port)}, f"ps 0 listens on the node's address only, not {listening}"
    target = tmp_path / "overwritten.pt"
    for op, meta in (("save", {"path": str(target)}), ("shutdown", {})):
        why = stranger_asks(address, op, meta)
        assert f"a connection starts with the transport's handshake, not {op!r}" in why, why
    with pytest.raises(Refused, match=r"refused this process: owner 0 \(incarnation 0\) did not prove it holds this "
                                      r"job's secret"):
        Connection(address, credentials=Credentials.fresh(Identity("owner", 0, 0)))
    assert not target.exists()
    assert owner_status(address, owner)["pid"] == status["pid"], "the same PS serves on"

    result = job.wait(240)
    assert result.returncode == 0, result.explain()
    out = result.stdout
    assert f"[worker0]: exactly once: each of the {2 * STEPS} batches applied once on each of 2 servers" in out, out
    assert "job succeeded" in out, out
    assert not target.exists()
    procs.wait_no_leftovers()
