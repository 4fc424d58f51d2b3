"""A POST whose reply is lost is retried by the client; the master must handle it once."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Iterator

import pytest
from test_api import Master, join

from convoy.control.protocol import messages as p
from convoy.control.protocol.client import MasterClient
from convoy.control.store import read_status


class ReplyDroppingProxy:
    """Forwards HTTP requests to the master; for the first ``drop`` requests it reads the master's
    whole reply and then closes the client's connection without passing it on."""

    def __init__(self, target: tuple[str, int], drop: int = 1) -> None:
        self.target, self.drop = target, drop
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.dropped: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client, socket.create_connection(self.target) as upstream:
            while True:
                request = _read_message(client)
                if not request:
                    return
                upstream.sendall(request)
                reply = _read_message(upstream)
                if self.drop > 0:
                    self.drop -= 1
                    self.dropped.append(request)
                    return  # the master has answered; the client never hears it
                client.sendall(reply)


def _read_message(sock: socket.socket) -> bytes:
    """One HTTP message (headers and a Content-Length body) from ``sock``; b'' at end of stream."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    started = Master(tmp_path / "run")
    yield started
    started.master.stop()


def test_a_join_whose_reply_was_lost_is_not_a_rejoin(master: Master) -> None:
    join(master.client(), "a", "10.0.0.1")
    proxy = ReplyDroppingProxy((master.host, master.port))
    try:
        through_proxy = MasterClient("127.0.0.1", proxy.port, master.master.token, 5.0)
        assert join(through_proxy, "b", "10.0.0.2") == 1, "the retry gets the first call's answer"
    finally:
        proxy.close()
    assert len(proxy.dropped) == 1 and b"/v1/join" in proxy.dropped[0]
    status = master.master.status()
    assert (status["round_id"], status["restart_count"]) == (1, 0), status
    kinds = [e["kind"] for e in read_status(master.run_dir, recent=100)["events"]]
    assert kinds == ["master_started", "node_joined", "node_joined", "round_closed"]


def test_a_retried_failure_report_restarts_the_job_once(master: Master) -> None:
    join(master.client(), "a", "10.0.0.1")
    join(master.client(), "b", "10.0.0.2")
    proxy = ReplyDroppingProxy((master.host, master.port))
    try:
        through_proxy = MasterClient("127.0.0.1", proxy.port, master.master.token, 5.0)
        report = p.WorkerExit(node_id="a", round_id=1, rank=0, local_rank=0, exitcode=1)
        assert through_proxy.call("/worker_exit", report, p.Ack).ok
        join(through_proxy, "a", "10.0.0.1")  # a new call: a new key, handled
    finally:
        proxy.close()
    assert master.master.job.restart_count == 1
    kinds = [e["kind"] for e in read_status(master.run_dir, recent=100)["events"]]
    assert kinds.count("worker_failed") == 1 and "stale_report" not in kinds


def test_a_reused_key_on_another_call_is_answered_from_the_cache(master: Master) -> None:
    body = p.JoinRequest(node_id="a", host="10.0.0.1", nproc=2, port=1).model_dump_json().encode()
    key = {"Idempotency-Key": "test-1"}
    first = master.raw("POST", "/v1/join", body, headers=key)
    again = master.raw("POST", "/v1/join", body, headers=key)
    assert first == again and first[0] == 200
    assert master.event_kinds().count("node_joined") == 1
    status, reply = master.raw("POST", "/v1/join", body, headers={"Idempotency-Key": "k" * 200})
    assert status == 400 and "Idempotency-Key" in reply["error"]
