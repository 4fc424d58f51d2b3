"""Issue 25: the master holds under load and attack. A real JobMaster on loopback, real sockets as clients."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import wait_for

from convoy.config import MasterConfig, RendezvousConfig
from convoy.control.api import ApiServer
from convoy.control.limits import Limits
from convoy.control.master import JobMaster
from convoy.control.protocol import messages as p
from convoy.control.protocol.client import MasterClient
from convoy.control.store import read_status
from convoy.errors import MasterUnreachableError


def _master(run_dir: Path, **config: Any) -> JobMaster:
    config = MasterConfig(host="127.0.0.1", port=0, run_dir=run_dir, rendezvous=RendezvousConfig(2, 2, 0.0, 60.0),
                          **config)
    config.validate()
    master = JobMaster(config, console=lambda line: None)
    master.start()
    return master


def _limited(master: JobMaster, limits: Limits) -> ApiServer:
    """A second server with tighter bounds in front of the same master (so a test need not wait 5 s)."""
    api = ApiServer(master, "127.0.0.1", 0, master.token, limits=limits)
    api.start()
    return api


@pytest.fixture
def master(tmp_path: Path) -> Iterator[JobMaster]:
    master = _master(tmp_path / "run")
    yield master
    master.stop()


def _connect(address: tuple[str, int], timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(address, timeout=timeout)


def _head(path: str, token: str | None, length: int | None = None, method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x"]
    if token is not None:
        lines.append(f"{p.TOKEN_HEADER}: Bearer {token}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status_ok(address: tuple[str, int], token: str) -> bool:
    conn = http.client.HTTPConnection(*address, timeout=5)
    try:
        conn.request("GET", p.API_PREFIX + "/status", headers={p.TOKEN_HEADER: f"Bearer {token}"})
        return conn.getresponse().status == 200
    finally:
        conn.close()


def test_the_token_is_checked_from_the_headers_before_any_body_is_read(master: JobMaster) -> None:
    """Item 1: 150 clients announce 1 MB - 1 of body and stall; each gets its 401 at once, none holds a thread."""
    socks = [_connect(master.api.address) for _ in range(150)]
    try:
        started = time.monotonic()
        for sock in socks:
            sock.sendall(_head(p.API_PREFIX + "/join", token=None, length=(1 << 20) - 1))
        for sock in socks:
            assert sock.recv(4096).startswith(b"HTTP/1.1 401"), "the refusal comes before any body"
        assert time.monotonic() - started < 3.0
        assert master.api.front.pool.busy == 0
    finally:
        for sock in socks:
            sock.close()
    assert "unauthorized" in [e["kind"] for e in read_status(master.config.run_dir, recent=100)["events"]]


def test_slow_headers_and_slow_bodies_are_timed_out(master: JobMaster) -> None:
    api = _limited(master, Limits(header_timeout_s=0.5, body_timeout_s=0.5))
    try:
        with _connect(api.address) as slow_head:
            slow_head.sendall(b"POST /v1/join HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            started = time.monotonic()
            assert slow_head.recv(4096) == b""  # closed by the master
            assert time.monotonic() - started < 2.0
        with _connect(api.address) as slow_body:
            slow_body.sendall(_head(p.API_PREFIX + "/join", token=master.token, length=100) + b'{"node')
            started = time.monotonic()
            answer = slow_body.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert time.monotonic() - started < 2.0
        wait_for(lambda: api.front.pool.busy == 0, 3, "the slow body's thread to be free")
    finally:
        api.stop()


def test_connections_are_bounded_in_all_and_per_client_and_the_newest_still_gets_in(master: JobMaster) -> None:
    api = _limited(master, Limits(max_pending=40, max_pending_per_client=20))
    socks = [_connect(api.address) for _ in range(60)]
    try:
        wait_for(lambda: api.front.pending <= 20 and api.front.shed >= 40, 5, "the oldest to be shed")
        assert _status_ok(api.address, master.token)
    finally:
        for sock in socks:
            sock.close()
        api.stop()


def test_heartbeats_are_served_first_when_every_handler_is_busy(master: JobMaster) -> None:
    """With the one handler thread held by a slow call, a heartbeat sent after a status call is served before it.
    The order is taken where the master's handlers begin: the clients' own replies may land in either order."""
    served: list[str] = []
    heartbeat, status = master.heartbeat, master.status
    release = threading.Event()

    def heartbeat_served(req: p.HeartbeatRequest) -> p.HeartbeatResponse:
        served.append("heartbeat")
        return heartbeat(req)

    def status_served() -> dict:
        served.append("status" if served else "slow call")
        if len(served) == 1:
            release.wait(10)  # holds the only handler (a long poll no longer does: it is parked without one)
        return status()

    master.heartbeat, master.status = heartbeat_served, status_served  # type: ignore[method-assign]
    api = _limited(master, Limits(max_handlers=1))  # its routes take the recording handlers

    def call(path: str, body: bytes | None, name: str) -> None:
        conn = http.client.HTTPConnection(*api.address, timeout=10)
        headers = {p.TOKEN_HEADER: f"Bearer {master.token}", "Connection": "close"}
        conn.request("POST" if body is not None else "GET", p.API_PREFIX + path, body=body, headers=headers)
        assert conn.getresponse().status == 200, name
        conn.close()

    beat = p.HeartbeatRequest(node_id="beater", round_id=master.job.round_id + 1).model_dump_json().encode()
    threads = [threading.Thread(target=call, args=("/status", None, "slow call"))]
    threads[0].start()
    wait_for(lambda: served == ["slow call"], 3, "the slow call to hold the only handler")
    for path, body, name in (("/status", None, "status"), ("/heartbeat", beat, "heartbeat")):
        threads.append(threading.Thread(target=call, args=(path, body, name)))
        threads[-1].start()
        wait_for(lambda: api.front.pool.waiting == len(threads) - 1, 3, f"{name} to wait for a handler")
    release.set()
    for thread in threads:
        thread.join(10)
    api.stop()
    assert served == ["slow call", "heartbeat", "status"]


ACCEPT_SPIN_SCRIPT = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from convoy.config import MasterConfig, RendezvousConfig
from convoy.control.master import JobMaster
from pathlib import Path
config = MasterConfig(host="127.0.0.1", port=0, run_dir=Path(sys.argv[1]), rendezvous=RendezvousConfig(1, 1, 0.0, 60.0))
config.validate()
master = JobMaster(config, console=lambda line: None)
master.start()
print(master.api.address[1], master.token, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_at_the_fd_limit_the_accept_loop_does_not_spin_and_a_new_request_is_served(tmp_path: Path) -> None:
    import sys

    import psutil

    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", ACCEPT_SPIN_SCRIPT, str(tmp_path / "run")], env=env,
                            stdout=subprocess.PIPE, text=True)
    socks: list[socket.socket] = []
    try:
        port_text, token = proc.stdout.readline().split()  # type: ignore[union-attr]
        address = ("127.0.0.1", int(port_text))
        socks = [_connect(address) for _ in range(120)]  # more than the master has descriptors for
        time.sleep(1.0)
        master = psutil.Process(proc.pid)
        before = master.cpu_times()
        time.sleep(2.0)
        after = master.cpu_times()
        busy = (after.user + after.system - before.user - before.system) / 2.0
        assert busy < 0.2, f"the master burnt {busy:.0%} of a core at its fd limit"
        assert _status_ok(address, token)
    finally:
        for sock in socks:
            sock.close()
        proc.kill()
        proc.wait()


def test_the_listen_backlog_takes_hundreds_of_agents_connecting_at_once(tmp_path: Path) -> None:
    """Item 2: before the server accepts anything, 300 connects complete (a backlog of 5 drops their SYNs)."""
    config = MasterConfig(host="127.0.0.1", port=0, run_dir=tmp_path / "run")
    config.validate()
    master = JobMaster(config, console=lambda line: None)
    socks: list[socket.socket] = []
    try:
        for _ in range(300):
            socks.append(_connect(master.api.address, timeout=0.5))
    finally:
        for sock in socks:
            sock.close()
        master.api.stop()
        master.store.close()


def test_keep_alive_requests_are_not_delayed_by_nagle(master: JobMaster) -> None:
    """Item 3: TCP_NODELAY on both ends; a keep-alive request takes well under the 40 ms of a delayed ACK."""
    client = MasterClient(*master.api.address, master.token, 5.0)
    request = p.HeartbeatRequest(node_id="n1", round_id=0)
    client.call("/heartbeat", request, p.HeartbeatResponse)
    assert client._conn is not None and client._conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    times = []
    for _ in range(30):
        started = time.perf_counter()
        client.call("/heartbeat", request, p.HeartbeatResponse)
        times.append(time.perf_counter() - started)
    client.close()
    assert sorted(times)[len(times) // 2] < 0.015, f"median {sorted(times)[len(times) // 2] * 1000:.1f} ms"


def _certificate(where: Path, name: str) -> tuple[Path, Path]:
    cert, key = where / f"{name}.pem", where / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


def test_tls_on_loopback_with_a_certificate_the_test_makes(tmp_path: Path) -> None:
    """Item 4: the master serves TLS; an agent's client trusts it through --tls-ca; plain HTTP and a wrong CA fail,
    the wrong CA at once (not retried as if the master were down)."""
    cert, key = _certificate(tmp_path, "master")
    other, _ = _certificate(tmp_path, "other")
    master = _master(tmp_path / "run", tls_cert=str(cert), tls_key=str(key))
    try:
        host, port = master.api.address
        client = MasterClient(host, port, master.token, 5.0, tls_ca=str(cert))
        reply = client.call("/heartbeat", p.HeartbeatRequest(node_id="n1", round_id=0), p.HeartbeatResponse)
        assert reply.job_status == "running" and isinstance(client._conn.sock, ssl.SSLSocket)  # type: ignore[union-attr]
        client.close()
        plain = MasterClient(host, port, master.token, 1.0)
        with pytest.raises(MasterUnreachableError):
            plain.call("/heartbeat", p.HeartbeatRequest(node_id="n1", round_id=0), p.HeartbeatResponse)
        started = time.monotonic()
        with pytest.raises(MasterUnreachableError, match="TLS"):
            MasterClient(host, port, master.token, 30.0, tls_ca=str(other)).call(
                "/heartbeat", p.HeartbeatRequest(node_id="n1", round_id=0), p.HeartbeatResponse)
        assert time.monotonic() - started < 5.0
    finally:
        master.stop()


def test_convoy_scale_reaches_a_tls_master_through_its_own_certificate(tmp_path: Path) -> None:
    """``convoy scale`` verifies a TLS master with the certificate the master serves (its saved config names it)."""
    import sys

    cert, key = _certificate(tmp_path, "master")
    master = _master(tmp_path / "run", tls_cert=str(cert), tls_key=str(key))
    try:
        done = subprocess.run([sys.executable, "-m", "convoy", "scale", "--run-dir", str(tmp_path / "run"),
                               "worker=2"], capture_output=True, text=True, timeout=30)
    finally:
        master.stop()
    assert done.returncode == 2, done.stderr
    assert "declares no roles" in done.stderr, "the master answered (over TLS) that this job has no roles"


def test_wire_details_server_header_bearer_case_and_strict_types(master: JobMaster) -> None:
    """Item 6: no Python version in Server; `bearer` in any case; booleans, strings, floats are not integers."""
    conn = http.client.HTTPConnection(*master.api.address, timeout=5)
    conn.request("GET", p.API_PREFIX + "/status", headers={p.TOKEN_HEADER: f"bearer {master.token}"})
    response = conn.getresponse()
    response.read()
    assert response.status == 200 and response.getheader("Server") == "convoy"
    for nproc in ("true", '"3"', "2.0"):
        body = f'{{"node_id": "n1", "host": "h", "nproc": {nproc}, "port": 5}}'.encode()
        conn.request("POST", p.API_PREFIX + "/join", body=body, headers={p.TOKEN_HEADER: f"BEARER {master.token}"})
        response = conn.getresponse()
        assert response.status == 400, (nproc, response.status, response.read())
        response.read()
    conn.close()


def test_state_and_logs_are_private(master: JobMaster, tmp_path: Path) -> None:
    """Item 5: the state file 0600 (and the run dir 0700); a worker's log 0600 in a 0700 directory."""
    from convoy.agent.log_pump import LogPump

    assert stat.S_IMODE(master.store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(master.config.run_dir.stat().st_mode) == 0o700
    read, write = os.pipe()
    with open(os.devnull, "wb") as sink, open(read, "rb", buffering=0) as stream:
        pump = LogPump(stream, sink, threading.Lock())
        log = tmp_path / "logs" / "worker0.log"
        pump.assign(0, log)
        pump.start()
        os.write(write, b"hello\n")
        os.close(write)
        pump.join(5)
    assert log.read_bytes() == b"hello\n"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and stat.S_IMODE(log.parent.stat().st_mode) == 0o700
