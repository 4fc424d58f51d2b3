"""The wire between workers and parameter servers: a message is an op name, a small JSON header and named
tensors, sent as raw bytes over TCP (benchmarks/ps_transport.py measured it against torch RPC and gloo
point-to-point). Servers and clients see only ``Message``, ``Connection`` and ``Listener``, so another transport
can replace this one without touching their logic."""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from convoy.errors import ConfigError, ConvoyError

HEADER_SIZE = struct.Struct("!Q")
REQUEST_S = 60.0
"""How long a connection waits to connect, and for each reply."""
SOCKET_BUFFER_BYTES = 4 << 20
DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                          torch.int64, torch.int32, torch.uint8, torch.bool)}


class TransportError(ConvoyError):
    """A parameter server or worker went away mid-message, or answered with an error."""


class ConnectionLost(TransportError):
    """The peer cannot be reached or went away: a worker may find the server's next incarnation."""


@dataclass
class Message:
    """One request or reply."""

    op: str
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _send_all(sock: socket.socket, message: Message) -> None:
    entries, buffers = [], []
    for name, tensor in message.tensors.items():
        flat = tensor.detach().contiguous().cpu()
        entries.append([name, str(flat.dtype), list(flat.shape)])
        buffers.append(memoryview(flat.reshape(-1).view(torch.uint8).numpy()) if flat.numel() else b"")
    header = json.dumps({"op": message.op, "meta": message.meta, "tensors": entries}).encode()
    sizes = [len(b) for b in buffers]
    prefix = HEADER_SIZE.pack(len(header)) + header + struct.pack(f"!{len(sizes)}Q", *sizes)
    sock.sendall(prefix)
    for buffer in buffers:
        if len(buffer):
            sock.sendall(buffer)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, size = 0, len(view)
    while got < size:
        count = sock.recv_into(view[got:], size - got)
        if count == 0:
            raise ConnectionLost("the peer closed the connection mid-message")
        got += count


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    _recv_into(sock, memoryview(data))
    return data


def _recv_message(sock: socket.socket) -> Message:
    (length,) = HEADER_SIZE.unpack(_recv_exact(sock, HEADER_SIZE.size))
    header = json.loads(bytes(_recv_exact(sock, length)))
    entries = header["tensors"]
    sizes = struct.unpack(f"!{len(entries)}Q", _recv_exact(sock, 8 * len(entries))) if entries else ()
    tensors = {}
    for (name, dtype, shape), size in zip(entries, sizes, strict=True):
        raw = torch.empty(size, dtype=torch.uint8)  # received in place: no zero-filled buffer, no copy after
        if size:
            _recv_into(sock, memoryview(raw.numpy()))
        tensors[name] = raw.view(DTYPES[dtype]).reshape(shape)
    return Message(header["op"], header["meta"], tensors)


def _tune(sock: socket.socket) -> None:
    """No Nagle delay on small replies, and buffers that hold a few MB of tensors per syscall."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


class Connection:
    """A worker's link to one server: ``request`` waits for the reply; one request at a time per connection."""

    def __init__(self, address: str, timeout: float = REQUEST_S) -> None:
        host, _, port = address.rpartition(":")
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as exc:
            raise ConnectionLost(f"cannot reach the parameter server at {address}: {exc}") from exc
        _tune(self.sock)
        self.address, self.lock = address, threading.Lock()

    def request(self, message: Message) -> Message:
        with self.lock:
            try:
                _send_all(self.sock, message)
                reply = _recv_message(self.sock)
            except ConnectionLost as exc:
                raise ConnectionLost(f"parameter server at {self.address} went away: {exc}") from exc
            except OSError as exc:
                raise ConnectionLost(f"parameter server at {self.address} went away: {exc}") from exc
        if reply.op == "error":
            kind = ConfigError if reply.meta.get("kind") == "ConfigError" else TransportError
            raise kind(f"parameter server at {self.address}: {reply.meta['message']}")
        return reply

    def settimeout(self, seconds: float) -> None:
        """How long a request may wait for its reply from now on."""
        self.sock.settimeout(seconds)

    def close(self) -> None:
        self.sock.close()


Handler = Callable[[Message], Message]
CLOSE_JOIN_S = 10.0


class Listener:
    """A server's end: accepts connections and answers each message with ``handler``'s reply, one thread per
    connection. A handler's ``ConvoyError`` goes back to that worker as an ``error`` reply; ``replied`` (if
    given) sees each reply once it is sent (where a server learns that its goodbye went out)."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 replied: Callable[[Message], None] | None = None) -> None:
        self.handler, self.replied = handler, replied
        self.connections: list[socket.socket] = []
        self.sock = socket.create_server((host, port))
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.closed = threading.Event()
        self.threads: list[threading.Thread] = []
        self.accepter = threading.Thread(target=self._accept, name="ps-accept", daemon=True)
        self.accepter.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            _tune(conn)
            self.connections.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), name="ps-conn", daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self.closed.is_set():
                try:
                    message = _recv_message(conn)
                except (TransportError, OSError):
                    return
                try:
                    reply = self.handler(message)
                except ConvoyError as exc:
                    reply = Message("error", {"message": str(exc), "kind": type(exc).__name__})
                try:
                    _send_all(conn, reply)
                except OSError:
                    return
                if self.replied is not None:
                    self.replied(reply)

    def close(self) -> None:
        """Stop accepting, wake every connection's thread and wait for it: a thread left inside torch while the
        interpreter exits can abort the process."""
        self.closed.set()
        for sock in (self.sock, *self.connections):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the peer
        self.sock.close()
        self.accepter.join(CLOSE_JOIN_S)
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(CLOSE_JOIN_S)
