"""The master's front door: one selector loop accepts every connection and reads its header block, so a client
without the token costs no thread and no body read; only screened requests reach the bounded set of handler
threads, heartbeats first."""

from __future__ import annotations

import errno
import heapq
import io
import itertools
import re
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Union

from convoy.errors import ConfigError
from convoy.local_http import DISCARD_S

HEADER_END = re.compile(rb"\r?\n\r?\n")
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
LOOP_TICK_S = 0.05
ACCEPT_BURST = 64
"""Connections accepted per wake-up before the loop serves the others again."""
DISCARD_BYTES = (1 << 20) + (1 << 16)


@dataclass
class Limits:
    """Bounds on what clients can hold; each names the resource an attacker without the token would exhaust."""

    backlog: int = 1024
    """Listen queue: many agents reattach at once after a master restart (the kernel caps it at somaxconn)."""
    header_timeout_s: float = 5.0
    """From connect until the whole header block has arrived."""
    body_timeout_s: float = 10.0
    """For the whole body of one request."""
    idle_timeout_s: float = 30.0
    """An authorized keep-alive connection between requests; the client reconnects after it."""
    max_pending: int = 4096
    """Connections whose headers are being read (or whose refusal is being drained); past it the oldest goes."""
    max_pending_per_client: int = 1024
    """The same, per client address: the oldest of that client goes, so a fast new request still gets in."""
    max_handlers: int = 256
    """Threads serving authorized connections; more wait their turn, heartbeats first."""
    max_header_bytes: int = 16 << 10


Screened = Union[int, bytes]
"""What the screen decides of a header block: a priority (lower first) to serve it, or a whole refusal to send."""


class Pages(Protocol):
    """Pages served beside the API (the dashboard): the API server hands them every request outside ``/v1``."""

    def screen(self, head: bytes, client: str) -> Screened: ...
    def serve(self, item: object) -> None: ...


class _Pending:
    __slots__ = ("sock", "client", "buffer", "deadline", "handshaking", "drain_left")

    def __init__(self, sock: socket.socket, client: tuple[str, int], deadline: float, handshaking: bool) -> None:
        self.sock, self.client, self.deadline, self.handshaking = sock, client, deadline, handshaking
        self.buffer = b""
        self.drain_left = -1
        """>= 0: refused; this many more bytes are read and dropped before it closes."""


class HandlerPool:
    """Runs ``serve`` on at most ``size`` threads; what comes when all are busy waits in priority order."""

    def __init__(self, size: int, serve: Callable[[object], None]) -> None:
        self.size, self._serve = size, serve
        self._lock = threading.Lock()
        self._waiting: list[tuple[int, int, object]] = []
        self._order = itertools.count()
        self.active = 0
        self.wake: threading.Condition | None = None
        """Notified when a request has to wait for a thread: the master's long polls held on it answer at once (the
        agent waits out the rest of its poll itself), so held polls never keep a round's waits from a thread."""

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, priority: int, item: object) -> None:
        with self._lock:
            queued = self.active >= self.size
            if queued:
                heapq.heappush(self._waiting, (priority, next(self._order), item))
            else:
                self.active += 1
        if queued:
            if self.wake is not None:
                with self.wake:
                    self.wake.notify_all()
            return
        threading.Thread(target=self._run, args=(item,), name="convoy-api-handler", daemon=True).start()

    def _run(self, item: object) -> None:
        while True:
            self._serve(item)
            with self._lock:
                if not self._waiting:
                    self.active -= 1
                    return
                item = heapq.heappop(self._waiting)[2]


class FrontDoor:
    """Listens (bound at construction, so a taken port is a ConfigError before any state), screens every
    request's header block with ``screen``, and hands the admitted ones to ``serve`` on the pool:
    ``serve((sock, client, bytes_read_so_far))``. ``listener``: a socket already bound and listening (a
    launcher that claimed the job's endpoint passes it on), used instead of binding ``host:port``."""

    def __init__(self, host: str, port: int, limits: Limits, screen: Callable[[bytes, str], Screened],
                 serve: Callable[[object], None], tls: ssl.SSLContext | None = None,
                 listener: socket.socket | None = None) -> None:
        self.limits, self._screen, self._tls = limits, screen, tls
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = listener or socket.create_server((host, port), family=family, backlog=limits.backlog)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is already in use: pick another --port or 0 for any") from exc
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        self._listener.setblocking(False)
        bound_host, bound_port = self._listener.getsockname()[:2]
        self.address = (str(bound_host), int(bound_port))
        """Where it listens (kept: the master still names it once the listener is closed at its stop)."""
        self.pool = HandlerPool(limits.max_handlers, serve)
        self._pending: dict[int, _Pending] = {}
        self._by_client: dict[str, dict[int, _Pending]] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._paused_until = 0.0
        """Out of descriptors with none to shed: the listener sits out until then (no busy loop)."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="convoy-api", daemon=True)
        self.shed = 0
        """Connections closed to make room (over a bound, or out of descriptors)."""

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        for pending in list(self._pending.values()):
            self._close(pending)
        self._selector.close()
        self._listener.close()

    def _loop(self) -> None:
        last_sweep = 0.0
        while not self._stopping.is_set():
            now = time.monotonic()
            if self._paused_until and now >= self._paused_until:
                self._paused_until = 0.0
                self._selector.register(self._listener, selectors.EVENT_READ, None)
            for key, _ in self._selector.select(LOOP_TICK_S):
                if key.data is None:
                    self._accept()
                elif key.data.sock.fileno() in self._pending:
                    self._readable(key.data)
            now = time.monotonic()
            if now - last_sweep >= LOOP_TICK_S:
                last_sweep = now
                for pending in [p for p in self._pending.values() if p.deadline <= now]:
                    self._close(pending)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BURST):
            try:
                sock, client = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno not in OUT_OF_FDS:
                    return  # the client gave up before we took it (ECONNABORTED): take the next
                if not self._shed_oldest(self._pending):  # nothing of ours to free: sit out a tick
                    self._selector.unregister(self._listener)
                    self._paused_until = time.monotonic() + LOOP_TICK_S
                    return
                continue
            self._admit(sock, client)

    def _admit(self, sock: socket.socket, client: tuple[str, int]) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle wait for the delayed ACK
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        pending = _Pending(sock, client, time.monotonic() + self.limits.header_timeout_s, self._tls is not None)
        fd = sock.fileno()
        self._pending[fd] = pending
        mine = self._by_client.setdefault(client[0], {})
        mine[fd] = pending
        self._selector.register(sock, selectors.EVENT_READ, pending)
        if len(mine) > self.limits.max_pending_per_client:
            self._shed_oldest(mine)
        if len(self._pending) > self.limits.max_pending:
            self._shed_oldest(self._pending)

    def _shed_oldest(self, among: dict[int, _Pending]) -> bool:
        if not among:
            return False
        self.shed += 1
        self._close(next(iter(among.values())))
        return True

    def _forget(self, pending: _Pending) -> None:
        fd = pending.sock.fileno()
        self._pending.pop(fd, None)
        mine = self._by_client.get(pending.client[0])
        if mine is not None:
            mine.pop(fd, None)
            if not mine:
                del self._by_client[pending.client[0]]
        self._selector.unregister(pending.sock)

    def _close(self, pending: _Pending) -> None:
        self._forget(pending)
        pending.sock.close()

    def _readable(self, pending: _Pending) -> None:
        sock = pending.sock
        try:
            if pending.handshaking:
                sock.do_handshake()  # type: ignore[attr-defined]
                pending.handshaking = False
            chunks = [sock.recv(1 << 16)]
            while isinstance(sock, ssl.SSLSocket) and sock.pending():  # decrypted bytes select cannot see
                chunks.append(sock.recv(1 << 16))
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:  # a reset, or a failed TLS handshake (a plain-HTTP client, an unknown CA)
            return self._close(pending)
        data = b"".join(chunks)
        if not data:
            return self._close(pending)
        if pending.drain_left >= 0:
            pending.drain_left -= len(data)
            if pending.drain_left < 0:
                self._close(pending)
            return
        pending.buffer += data
        end = HEADER_END.search(pending.buffer)
        if end is None:
            if len(pending.buffer) > self.limits.max_header_bytes:
                self._refuse(pending, plain_reply(431, "request headers too large"))
            return
        verdict = self._screen(pending.buffer[:end.end()], pending.client[0])
        if isinstance(verdict, bytes):
            return self._refuse(pending, verdict)
        self._forget(pending)
        sock.setblocking(True)
        self.pool.submit(verdict, (sock, pending.client, pending.buffer))

    def _refuse(self, pending: _Pending, reply: bytes) -> None:
        """Send the refusal at once (a small write into an empty socket buffer), then drop what the client
        still sends for a bounded time."""
        try:
            pending.sock.send(reply)
        except (OSError, ssl.SSLError):
            return self._close(pending)
        pending.drain_left = DISCARD_BYTES
        pending.deadline = time.monotonic() + DISCARD_S
        pending.buffer = b""


def plain_reply(code: int, error: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, with the API's ``{"error": ...}`` body."""
    import json
    from http import HTTPStatus

    body = json.dumps({"error": error}).encode()
    head = (f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\nServer: convoy\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class PrefixedReader(io.RawIOBase):
    """A socket's byte stream with the bytes the front door already read in front of it."""

    def __init__(self, sock: socket.socket, prefix: bytes) -> None:
        self._sock, self._prefix = sock, memoryview(prefix)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        if self._prefix:
            count = min(len(buffer), len(self._prefix))
            buffer[:count] = self._prefix[:count]
            self._prefix = self._prefix[count:]
            return count
        return self._sock.recv_into(buffer)


class SocketWriter(io.BufferedIOBase):
    """Writes go out whole (``sendall``): a raw socket file may write only part of what it is given."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self._sock.sendall(data)
        return len(data)


def server_tls(cert: str, key: str) -> ssl.SSLContext:
    """The master's TLS context from a certificate chain and its private key (PEM files)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--tls-cert {cert!r} / --tls-key {key!r} cannot be loaded: {exc}; give a PEM "
                          "certificate and its private key") from exc
    return context
