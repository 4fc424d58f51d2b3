"""The master's front door: one selector loop accepts every connection and reads its header block, so a client
without the token costs no thread and no body read; only screened requests reach the bounded set of handler
threads, heartbeats first."""

from __future__ import annotations

import collections
import errno
import io
import re
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Union

from convoy.control.handler_pool import HandlerPool
from convoy.errors import ConfigError
from convoy.local_http import DISCARD_S

HEADER_END = re.compile(rb"\r?\n\r?\n")
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
LOOP_TICK_S = 0.05
ACCEPT_BURST = 256
"""Connections accepted per wake-up before the loop serves the others again."""
DISCARD_BYTES = (1 << 20) + (1 << 16)


@dataclass
class Limits:
    """Bounds on what clients can hold; each names the resource an attacker without the token would exhaust."""

    backlog: int = 4096
    """Listen queue: many agents reattach at once after a master restart, or when a round ends (their main
    connections idled out meanwhile); an overflow drops SYNs, which the agents send again only after 1 s, 3 s, 7 s
    (the kernel caps it at net.core.somaxconn)."""
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
    max_handlers: int = 32
    """Threads serving authorized requests; more wait their turn, heartbeats first. No thread waits for a client
    between requests or for a long poll's news, so a few keep both cores busy; more only contend for the master's
    lock (256 answered 4096 parked heartbeats more slowly)."""
    max_idle: int = 16384
    """Keep-alive connections between requests (each agent holds two); past it the longest idle goes."""
    max_header_bytes: int = 16 << 10


Screened = Union[int, tuple[int, object], bytes]
"""What the screen decides of a header block: a priority (lower first) to serve it, alone or with what the screen
made of the head (handed on, so that the handler does not parse it again), or a whole refusal to send."""


class Pages(Protocol):
    """Pages served beside the API (the dashboard): the API server hands them every request outside ``/v1``."""

    def screen(self, head: bytes, client: str) -> Screened: ...
    def serve(self, item: object) -> None: ...


class _Pending:
    __slots__ = ("sock", "client", "buffer", "deadline", "handshaking", "drain_left", "idle")

    def __init__(self, sock: socket.socket, client: tuple[str, int], deadline: float, handshaking: bool) -> None:
        self.sock, self.client, self.deadline, self.handshaking = sock, client, deadline, handshaking
        self.buffer = b""
        self.drain_left = -1
        """>= 0: refused; this many more bytes are read and dropped before it closes."""
        self.idle = False
        """A keep-alive connection handed back after a request, until its next one begins."""


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
        self._idle: dict[int, _Pending] = {}
        """Keep-alive connections between requests, oldest first (so also by deadline): no thread waits on them."""
        self._returned: collections.deque[tuple[socket.socket, tuple[str, int], bytes]] = collections.deque()
        self._returning = threading.Lock()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_read, selectors.EVENT_READ, "wake")
        self._paused_until = 0.0
        """Out of descriptors with none to shed: the listener sits out until then (no busy loop)."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="convoy-api", daemon=True)
        self.shed = 0
        """Connections closed to make room (over a bound, or out of descriptors)."""

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def readmit(self, sock: socket.socket, client: tuple[str, int], leftover: bytes = b"") -> None:
        """A handler is done with a keep-alive connection: the loop watches it for the next request (``leftover``:
        what was read of it already). Any thread may call it; after ``stop`` the connection is closed."""
        with self._returning:  # (with ``stop``'s last look: none is left behind open)
            if self._stopping.is_set():
                sock.close()
                return
            self._returned.append((sock, client, leftover))
        try:
            self._wake_write.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the loop has a wake-up byte unread already (or is stopping)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        for pending in [*self._pending.values(), *self._idle.values()]:
            self._close(pending)
        with self._returning:
            while self._returned:
                self._returned.popleft()[0].close()
        self._selector.close()
        self._listener.close()
        self._wake_read.close()
        self._wake_write.close()

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
                elif key.data == "wake":
                    self._take_returned()
                elif key.data.sock.fileno() in (self._idle if key.data.idle else self._pending):
                    self._readable(key.data)
            now = time.monotonic()
            if now - last_sweep >= LOOP_TICK_S:
                last_sweep = now
                for pending in [p for p in self._pending.values() if p.deadline <= now]:
                    self._close(pending)
                for pending in list(self._idle.values()):  # oldest first, so by deadline
                    if pending.deadline > now:
                        break
                    self._close(pending)

    def _take_returned(self) -> None:
        try:
            while self._wake_read.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._returned:
            sock, client, leftover = self._returned.popleft()
            sock.setblocking(False)
            pending = _Pending(sock, client, time.monotonic() + self.limits.idle_timeout_s, False)
            pending.idle = True
            self._idle[sock.fileno()] = pending
            self._selector.register(sock, selectors.EVENT_READ, pending)
            if len(self._idle) > self.limits.max_idle:
                self._shed_oldest(self._idle)
            if leftover:  # a request that came right behind the last one
                self._take(pending, leftover)

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
        self._idle.pop(fd, None)
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
        self._take(pending, data)

    def _take(self, pending: _Pending, data: bytes) -> None:
        if pending.idle:  # its next request has begun: it has the header time-out to arrive
            del self._idle[pending.sock.fileno()]
            pending.idle = False
            pending.deadline = time.monotonic() + self.limits.header_timeout_s
            self._pending[pending.sock.fileno()] = pending
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
        priority, screened = verdict if isinstance(verdict, tuple) else (verdict, None)
        self._forget(pending)
        pending.sock.setblocking(True)
        self.pool.submit(priority, (pending.sock, pending.client, pending.buffer, screened))

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


def close_connection(sock: socket.socket) -> None:
    """Shut a connection down both ways (the client sees the end at once), then close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


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

    def readinto(self, buffer: bytearray | memoryview) -> int | None:  # type: ignore[override]
        if self._prefix:
            count = min(len(buffer), len(self._prefix))
            buffer[:count] = self._prefix[:count]
            self._prefix = self._prefix[count:]
            return count
        try:
            return self._sock.recv_into(buffer)
        except (BlockingIOError, ssl.SSLWantReadError):
            return None  # a socket set not to block has nothing yet (``unread`` asks so)


def unread(reader: io.BufferedReader, sock: socket.socket) -> bytes:
    """What ``reader`` took in beyond the request it served (a client's next request, sent right behind), without
    waiting for more; the socket is left not blocking, as the front door keeps it."""
    sock.setblocking(False)
    try:
        data = reader.read1(1 << 16) or b""
        while isinstance(sock, ssl.SSLSocket) and sock.pending():  # decrypted bytes select cannot see
            data += sock.recv(1 << 16)
    except (BlockingIOError, ssl.SSLWantReadError):
        pass
    return data


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
