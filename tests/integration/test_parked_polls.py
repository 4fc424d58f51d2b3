"""Issue 54: the master's threads are not held by what waits. A real JobMaster behind a server of two handler threads:
forty nodes' heartbeats long-poll at once on keep-alive connections, and the master still answers a status call at
once; when the job moves every poll is answered, and each connection carries its next request."""

from __future__ import annotations

import http.client
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from helpers import wait_for

from convoy.config import MasterConfig, RendezvousConfig
from convoy.control.api import ApiServer
from convoy.control.limits import Limits
from convoy.control.long_polls import LongPolls
from convoy.control.master import JobMaster
from convoy.control.protocol import messages as p

NODES = 40


@pytest.fixture
def master(tmp_path: Path) -> Iterator[JobMaster]:
    config = MasterConfig(host="127.0.0.1", port=0, run_dir=tmp_path / "run", rendezvous=RendezvousConfig(1, 1, 0.0,
                                                                                                             60.0))
    config.validate()
    master = JobMaster(config, console=lambda line: None)
    master.start()
    yield master
    master.stop()


def _post(conn: http.client.HTTPConnection, token: str, path: str, body: bytes) -> tuple[int, bytes]:
    conn.request("POST", p.API_PREFIX + path, body=body, headers={p.TOKEN_HEADER: f"Bearer {token}"})
    reply = conn.getresponse()
    return reply.status, reply.read()


def test_parked_heartbeats_hold_no_thread_and_all_answer_when_the_job_moves(master: JobMaster) -> None:
    api = ApiServer(master, "127.0.0.1", 0, master.token, limits=Limits(max_handlers=2),
                    long_polls=LongPolls(master._changed, master.polls.epoch))
    api.start()
    conns = [http.client.HTTPConnection(*api.address, timeout=30) for _ in range(NODES)]
    replies: dict[int, tuple[int, bytes, float]] = {}

    def beat(index: int) -> None:
        body = p.HeartbeatRequest(node_id=f"node{index}", round_id=master.job.round_id,
                                  wait_s=30.0).model_dump_json().encode()
        status, data = _post(conns[index], master.token, "/heartbeat", body)
        replies[index] = (status, data, time.monotonic())

    try:
        threads = [threading.Thread(target=beat, args=(index,)) for index in range(NODES)]
        for thread in threads:
            thread.start()
        wait_for(lambda: api.long_polls.parked == NODES, 10, "every heartbeat to be parked")
        # (a thread parks its poll, then counts itself free: both are seen in turn)
        wait_for(lambda: api.front.pool.busy == 0, 2, "a parked poll to hold no handler thread")
        status_conn = http.client.HTTPConnection(*api.address, timeout=5)
        began = time.monotonic()
        status_conn.request("GET", p.API_PREFIX + "/status", headers={p.TOKEN_HEADER: f"Bearer {master.token}"})
        assert status_conn.getresponse().status == 200
        assert time.monotonic() - began < 2.0, "the status call waited behind the parked polls"
        status_conn.close()
        assert replies == {}
        moved = time.monotonic()
        master.abort("the test ends the job")
        for thread in threads:
            thread.join(10)
        assert len(replies) == NODES
        for status, data, at in replies.values():
            answer = p.HeartbeatResponse.model_validate_json(data)
            assert status == 200 and answer.job_status == "failed" and at - moved < 5.0
        sockets = [conn.sock for conn in conns]
        for index, conn in enumerate(conns):  # the same connection carries the next request
            body = p.HeartbeatRequest(node_id=f"node{index}", round_id=master.job.round_id).model_dump_json().encode()
            assert _post(conn, master.token, "/heartbeat", body)[0] == 200
        assert [conn.sock for conn in conns] == sockets
        wait_for(lambda: api.front.idle == NODES, 5, "each keep-alive connection back with the front door")
        wait_for(lambda: api.front.pool.busy == 0, 2, "every handler thread free")
    finally:
        for conn in conns:
            conn.close()
        api.stop()


def test_a_keep_alive_connection_idle_past_its_time_out_is_closed_by_the_front_door(master: JobMaster) -> None:
    api = ApiServer(master, "127.0.0.1", 0, master.token, limits=Limits(max_handlers=1, idle_timeout_s=0.3))
    api.start()
    conn = http.client.HTTPConnection(*api.address, timeout=5)
    try:
        conn.request("GET", p.API_PREFIX + "/status", headers={p.TOKEN_HEADER: f"Bearer {master.token}"})
        assert conn.getresponse().read()
        wait_for(lambda: api.front.idle == 1, 3, "the connection to be idle at the front door")
        wait_for(lambda: api.front.idle == 0, 3, "the idle connection to be closed after its time-out")
        assert conn.sock is not None and conn.sock.recv(1) == b""
    finally:
        conn.close()
        api.stop()


def test_a_large_round_goes_gzipped_to_a_client_that_accepts_it_and_plain_to_one_that_does_not(tmp_path: Path) -> None:
    from convoy.control.protocol.client import MasterClient

    count = 1000  # a membership of about 75 KB: past GZIP_AT
    config = MasterConfig(host="127.0.0.1", port=0, run_dir=tmp_path / "run",
                          rendezvous=RendezvousConfig(count, count, 0.0, 60.0))
    config.validate()
    master = JobMaster(config, console=lambda line: None)
    master.start()
    try:
        client = MasterClient(*master.api.address, master.token)
        for index in range(count):
            client.call("/join", p.JoinRequest(node_id=f"n{index}", host="127.0.0.1", nproc=1, port=29500,
                                                instance=f"i{index}"), p.JoinResponse)
        wait = p.WaitRequest(node_id="n5", round_id=1, timeout_s=5.0)
        reply = client.call("/wait", wait, p.WaitResponse, wait_s=5.0)
        assert reply.state == "ready" and reply.round is not None and len(reply.round.members) == count
        raw = http.client.HTTPConnection(*master.api.address, timeout=10)
        for encoding, expected in (("gzip", "gzip"), ("identity", None)):
            raw.request("POST", p.API_PREFIX + "/wait", body=wait.model_dump_json().encode(),
                        headers={p.TOKEN_HEADER: f"Bearer {master.token}", "Accept-Encoding": encoding})
            answer = raw.getresponse()
            body = answer.read()
            assert answer.status == 200 and answer.getheader("Content-Encoding") == expected
            assert (len(body) < 20_000) == (expected == "gzip")
        raw.close()
        client.close()
    finally:
        master.stop()


def test_two_requests_sent_back_to_back_on_one_connection_are_both_answered_in_order(master: JobMaster) -> None:
    """The second request arrives with the first (pipelined): the bytes the handler read past the first go back to
    the front door with the connection, and the second is served from them."""
    import socket

    head = (f"GET {p.API_PREFIX}/status HTTP/1.1\r\nHost: x\r\n{p.TOKEN_HEADER}: Bearer {master.token}\r\n\r\n"
            f"GET {p.API_PREFIX}/openapi.json HTTP/1.1\r\nHost: x\r\n{p.TOKEN_HEADER}: Bearer {master.token}\r\n"
            "Connection: close\r\n\r\n").encode()
    with socket.create_connection(master.api.address, timeout=10) as sock:
        sock.sendall(head)
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
    replies = received.split(b"HTTP/1.1 ")[1:]
    assert [reply[:3] for reply in replies] == [b"200", b"200"]
    assert b'"job_id"' in replies[0] and b'"openapi"' in replies[1]
