"""A lean HTTP/1.1 keep-alive client for a worker's calls to its node's agent (plain HTTP on this host), and
how any of convoy's servers drops a refused request's body (``discard_body``).

``http.client`` spends about 0.5 ms of Python per call (header objects, the ``email`` parser); a rank that
reports every step pays that on its sender thread, so this client writes the request in one ``sendall`` and
reads only the status line, ``Content-Length`` and ``Connection`` of the answer. It speaks to convoy's own
agent API, which always sends ``Content-Length``; anything else it cannot frame is a ``ProtocolError``, and the
caller drops the connection and tries again on a new one.
"""

from __future__ import annotations

import socket
import time
from typing import Any

MAX_HEAD = 64 * 1024
"""The longest status line plus headers accepted from the agent."""
MAX_BODY = 64 * 1024 * 1024
DISCARD_S = 2.0
"""How long a refused request's body is read and dropped before the connection closes (closing with
unread bytes resets it, and the client may lose the answer)."""


class ProtocolError(OSError):
    """An answer this client cannot frame (no Content-Length, a head too long, a closed connection)."""


class Connection:
    """One keep-alive connection to ``host:port``, opened on the first call and again after any error."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._sock: socket.socket | None = None
        self._buffer = b""
        self._host_header = f"{host}:{port}".encode()

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """The answer's status and body; an OSError (ProtocolError included) leaves the connection closed."""
        head = [b"POST ", path.encode(), b" HTTP/1.1\r\nHost: ", self._host_header, b"\r\nContent-Length: ",
                str(len(body)).encode(), b"\r\n"]
        for name, value in headers.items():
            head += [name.encode(), b": ", value.encode(), b"\r\n"]
        head.append(b"\r\n")
        try:
            sock = self._connected()
            sock.sendall(b"".join(head) + body)
            return self._answer(sock)
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock, self._buffer = None, b""

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock, self._buffer = sock, b""
        return self._sock

    def _answer(self, sock: socket.socket) -> tuple[int, bytes]:
        end = self._buffer.find(b"\r\n\r\n")
        while end < 0:
            if len(self._buffer) > MAX_HEAD:
                raise ProtocolError(f"the agent's answer has a head over {MAX_HEAD} bytes")
            self._read(sock)
            end = self._buffer.find(b"\r\n\r\n")
        lines = self._buffer[:end].split(b"\r\n")
        self._buffer = self._buffer[end + 4:]
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"the agent answered {lines[0][:100]!r}, not an HTTP/1.x status line")
        length, closing = -1, parts[0] == b"HTTP/1.0"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length" and value.strip().isdigit():
                length = int(value)
            elif name == b"connection":
                closing = value.strip().lower() == b"close"
        if not 0 <= length <= MAX_BODY:
            raise ProtocolError("the agent's answer has no usable Content-Length")
        while len(self._buffer) < length:
            self._read(sock)
        data, self._buffer = self._buffer[:length], self._buffer[length:]
        if closing:
            self.close()
        return int(parts[1]), data

    def _read(self, sock: socket.socket) -> None:
        chunk = sock.recv(65536)
        if not chunk:
            raise ProtocolError("the agent closed the connection before its answer was whole")
        self._buffer += chunk


def discard_body(connection: Any, rfile: Any, length: int) -> None:
    """Read and drop a refused body (for at most DISCARD_S) before the connection closes: closing with unread
    bytes resets it, and the client may lose the answer before it reads it."""
    deadline = time.monotonic() + DISCARD_S
    connection.settimeout(DISCARD_S)
    try:
        while length > 0 and time.monotonic() < deadline:
            chunk = rfile.read1(min(length, 1 << 16))
            if not chunk:
                return
            length -= len(chunk)
    except OSError:  # timed out or gone: the answer was sent, the connection closes anyway
        return
