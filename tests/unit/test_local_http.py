"""The lean keep-alive client a worker uses for its agent, against a raw socket server that answers as it is
told: one connection serves many calls, an answer in one-byte pieces is put together, ``Connection: close``
and a dropped connection open a new one, and an answer it cannot frame is an error, not a hang."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable, Iterator

import pytest

from convoy.control.protocol import training as tp
from convoy.local_http import Connection, ProtocolError
from convoy.worker.shards import AgentBackend

Answer = Callable[[int, bytes], "bytes | tuple[bytes] | None"]
"""(the connection's request number, the request) -> the bytes to send; a 1-tuple: send them, then close;
None: close without answering."""


class Server:
    def __init__(self, answer: Answer, pieces: int = 0) -> None:
        self.answer, self.pieces = answer, pieces
        self.accepted = 0
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        buffer, number = b"", 0
        with conn:
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buffer += chunk
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                request, buffer = head + b"\r\n\r\n" + buffer[:length], buffer[length:]
                self.requests.append(request)
                out = self.answer(number, request)
                number += 1
                if out is None:
                    return
                closing = isinstance(out, tuple)
                out = out[0] if isinstance(out, tuple) else out
                if self.pieces:
                    for i in range(len(out)):
                        conn.sendall(out[i:i + 1])
                        time.sleep(0.0005)
                else:
                    conn.sendall(out)
                if closing:
                    return

    def close(self) -> None:
        self.sock.close()


def ok(body: bytes = b'{"version":3}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    made: list[Server] = []

    def start(answer: Answer, pieces: int = 0) -> Server:
        made.append(Server(answer, pieces))
        return made[-1]

    yield start
    for server in made:
        server.close()


def test_one_connection_serves_many_calls_and_sends_the_body_and_headers(serve: Callable[..., Server]) -> None:
    server = serve(lambda n, request: ok(b'{"n":%d}' % n))
    conn = Connection("127.0.0.1", server.port, 5.0)
    answers = [conn.post("/v1/x", b'{"a":1}', {"Authorization": "Bearer t"}) for _ in range(5)]
    assert answers == [(200, b'{"n":%d}' % n) for n in range(5)]
    assert server.accepted == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x HTTP/1.1\r\n") and b"\r\nAuthorization: Bearer t\r\n" in first
    assert b"\r\nContent-Length: 7\r\n" in first and first.endswith(b'\r\n\r\n{"a":1}')


def test_an_answer_in_one_byte_pieces_is_put_together(serve: Callable[..., Server]) -> None:
    server = serve(lambda n, request: ok(b'{"version":%d}' % (10 + n)), pieces=1)
    conn = Connection("127.0.0.1", server.port, 5.0)
    assert conn.post("/v1/x", b"{}", {}) == (200, b'{"version":10}')
    assert conn.post("/v1/x", b"{}", {}) == (200, b'{"version":11}')
    assert server.accepted == 1


def test_connection_close_and_a_dropped_connection_open_a_new_one(serve: Callable[..., Server]) -> None:
    server = serve(lambda n, request: ok(extra=b"Connection: close\r\n"))
    conn = Connection("127.0.0.1", server.port, 5.0)
    for _ in range(3):
        assert conn.post("/v1/x", b"{}", {})[0] == 200
    assert server.accepted == 3
    dropping = serve(lambda n, request: None if n == 1 else ok())
    conn = Connection("127.0.0.1", dropping.port, 5.0)
    assert conn.post("/v1/x", b"{}", {})[0] == 200
    with pytest.raises(ProtocolError, match="closed the connection"):
        conn.post("/v1/x", b"{}", {})
    assert conn.post("/v1/x", b"{}", {})[0] == 200 and dropping.accepted == 2


@pytest.mark.parametrize(("answer", "words"), [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", "no usable Content-Length"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000, "head over"),
    ((b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort",), "closed the connection"),
])
def test_an_answer_it_cannot_frame_is_an_error_and_closes(serve: Callable[..., Server],
                                                          answer: bytes | tuple[bytes], words: str) -> None:
    server = serve(lambda n, request: answer if server.accepted == 1 else ok())  # bad on the first connection
    conn = Connection("127.0.0.1", server.port, 5.0)
    with pytest.raises(ProtocolError, match=words):
        conn.post("/v1/x", b"{}", {})
    assert conn.post("/v1/x", b"{}", {})[0] == 200 and server.accepted == 2


def test_the_agent_backend_tries_again_on_a_new_connection(serve: Callable[..., Server]) -> None:
    server = serve(lambda n, request: None if server.accepted == 1 else ok(b'{"version":7}'))
    backend = AgentBackend(f"http://127.0.0.1:{server.port}", "token", unreachable_s=5.0, call_timeout_s=5.0)
    report = tp.StatusReport(role="default", rank=0, incarnation=1, sent_at=time.time())
    answer = backend.call("/train/report", report, tp.StatusAck)
    assert isinstance(answer, tp.StatusAck) and answer.version == 7 and server.accepted == 2
