"""Corrupt requests for benchmarks/faults.py: garbage, wrong or missing tokens, oversize bodies.

``barrage()`` sends them to a master's API, one connection each, round robin for a while, with
a few connections left half-open (headers never finished) the whole time, and counts what came
back: the HTTP status, or ``closed`` (no answer before the connection ended) or ``timeout``.
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections import Counter
from collections.abc import Callable

ANSWER_TIMEOUT_S = 3.0
HALF_OPEN = 16


def _post(path: str, body: bytes, auth: str | None, length: str | None = None) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: master", "Content-Type: application/json",
            f"Content-Length: {len(body) if length is None else length}"]
    if auth is not None:
        head.append(f"Authorization: {auth}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def requests(token: str, seed: int) -> list[tuple[str, bytes, bool]]:
    """(name, bytes to send, whether to close our sending side after them) for each kind of bad request."""
    rng = random.Random(seed)
    good = f"Bearer {token}"
    join = json.dumps({"node_id": "local0", "host": "127.0.0.1", "nproc": 1, "port": 5000}).encode()
    heartbeat = json.dumps({"node_id": "local0", "round_id": 1, "wait_s": 0}).encode()
    return [
        ("random bytes", bytes(rng.getrandbits(8) for _ in range(512)) + b"\r\n\r\n", False),
        ("TLS hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64) + b"\r\n\r\n", False),
        ("no token", b"GET /v1/status HTTP/1.1\r\nHost: master\r\n\r\n", False),
        ("abort, no token", _post("/v1/abort", b'{"reason": "x"}', None), False),
        ("leave, wrong token", _post("/v1/leave", b'{"node_id": "local0"}', "Bearer " + "0" * 32), False),
        ("heartbeat, wrong scheme", _post("/v1/heartbeat", heartbeat, f"Basic {token}"), False),
        ("truncated json", _post("/v1/join", join[:17], good), False),
        ("wrong types", _post("/v1/worker_exit", b'{"node_id": 7, "round_id": "x", "rank": []}', good), False),
        ("out of range", _post("/v1/join", join.replace(b'"nproc": 1', b'"nproc": -3'), good), False),
        ("oversize body", _post("/v1/join", b"", good, length=str(64 << 20)), False),
        ("negative length", _post("/v1/join", b"", good, length="-5"), False),
        ("length not a number", _post("/v1/join", b"{}", good, length="ten"), False),
        ("short body", _post("/v1/join", join[:10], good, length="1000"), True),
        ("long request line", b"GET /v1/" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", False),
        ("too many headers", b"GET /v1/status HTTP/1.1\r\n" + b"X-A: b\r\n" * 150 + b"\r\n", False),
        ("unknown path", b"GET /v1/../../etc/passwd HTTP/1.1\r\nAuthorization: " + good.encode() + b"\r\n\r\n",
         False),
        ("binary zero path", b"POST /v1/\x00join HTTP/1.1\r\nContent-Length: 0\r\n\r\n", False),
    ]


def _send(host: str, port: int, data: bytes, half_close: bool) -> str:
    """Send one request on a fresh connection; the status code it got, or closed/timeout."""
    try:
        with socket.create_connection((host, port), timeout=ANSWER_TIMEOUT_S) as sock:
            try:
                sock.sendall(data)
                if half_close:
                    sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server may answer and close before it has read everything
            answer = b""
            while b"\r\n" not in answer and len(answer) < 4096:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
    except TimeoutError:
        return "timeout"
    except OSError:
        return "closed"
    parts = answer.split(b" ", 2)
    return parts[1].decode(errors="replace") if answer.startswith(b"HTTP/") and len(parts) > 1 else "closed"


def barrage(host: str, port: int, token: str, duration_s: float, seed: int,
            during: Callable[[], None] = lambda: None) -> Counter[str]:
    """Send bad requests round robin for ``duration_s``; ``during`` runs between requests."""
    held: list[socket.socket] = []
    answers: Counter[str] = Counter()
    try:
        for _ in range(HALF_OPEN):  # each holds a server thread, waiting for the rest of its headers
            try:
                sock = socket.create_connection((host, port), timeout=ANSWER_TIMEOUT_S)
                sock.sendall(b"POST /v1/join HTTP/1.1\r\nContent-Length: 100\r\n")
                held.append(sock)
            except OSError:
                answers["half-open refused"] += 1
        kinds = requests(token, seed)
        deadline = time.monotonic() + duration_s
        index = 0
        while time.monotonic() < deadline:
            _name, data, half_close = kinds[index % len(kinds)]
            answers[_send(host, port, data, half_close)] += 1
            index += 1
            during()
    finally:
        for sock in held:
            sock.close()
    return answers
