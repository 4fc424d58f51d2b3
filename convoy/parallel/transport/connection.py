"""A caller's link to one role service: connect, prove who it is (handshake.py, over TLS where the job speaks
TLS), then one request and its reply at a time."""

from __future__ import annotations

import socket
import ssl
import threading

from convoy.errors import ConfigError
from convoy.parallel.transport.errors import REFUSALS, ConnectionLost, Refused, TransportError
from convoy.parallel.transport.handshake import Credentials, Identity, caller_handshake
from convoy.parallel.transport.tls import wrap_caller
from convoy.parallel.transport.wire import Limits, Message, recv_message, send_message

REQUEST_S = 60.0
"""How long a connection waits to connect, and for each reply."""
SOCKET_BUFFER_BYTES = 4 << 20


def tune(sock: socket.socket) -> None:
    """No Nagle delay on small replies, and buffers that hold a few MB of tensors per syscall."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


class Connection:
    """A process's link to one role service at ``address``; ``credentials`` default to the process's own (its
    agent's ``CONVOY_ROLE_SECRET``). Raises ``Refused`` when the service turns it away, or cannot prove itself."""

    def __init__(self, address: str, timeout: float = REQUEST_S, credentials: Credentials | None = None,
                 limits: Limits | None = None, service: str = "role service") -> None:
        self.address, self.service, self.lock = address, service, threading.Lock()
        self.credentials = credentials or Credentials.from_env()
        self.limits = limits or Limits()
        host, _, port = address.rpartition(":")
        try:
            raw = socket.create_connection((host, int(port)), timeout=timeout)
        except (OSError, ValueError) as exc:
            raise ConnectionLost(f"cannot reach the {service} at {address}: {exc}") from exc
        tune(raw)
        self.sock: socket.socket = raw
        try:
            certificate = b""
            if self.credentials.tls:
                self.sock, certificate = wrap_caller(raw)
            self.peer: Identity = caller_handshake(self.sock, self.credentials, certificate)
        except Refused as exc:
            self.sock.close()
            raise type(exc)(f"the {service} at {address} refused this process: {exc}") from exc
        except ssl.SSLError as exc:
            self.sock.close()
            raise Refused(f"the {service} at {address} does not speak TLS as this job does ({exc.reason}): "
                          "caller and service must be of one job") from exc
        except (TransportError, OSError) as exc:
            self.sock.close()
            raise ConnectionLost(f"the {service} at {address} went away during the handshake: {exc}") from exc

    def request(self, message: Message) -> Message:
        with self.lock:
            try:
                send_message(self.sock, message)
                reply = recv_message(self.sock, self.limits)
            except Refused as exc:  # a reply past this side's bounds
                self.close()
                raise type(exc)(f"the {self.service} at {self.address} sent a reply refused here: {exc}") from exc
            except (TransportError, OSError) as exc:
                raise ConnectionLost(f"the {self.service} at {self.address} went away: {exc}") from exc
        if reply.op == "error":
            kind, text = str(reply.meta.get("kind")), reply.meta.get("message")
            if kind in REFUSALS:
                self.close()  # the service has closed its end
                raise REFUSALS[kind](f"the {self.service} at {self.address} refused this process: {text}")
            error = ConfigError if kind == "ConfigError" else TransportError
            raise error(f"{self.service} at {self.address}: {text}")
        return reply

    def settimeout(self, seconds: float) -> None:
        """How long a request may wait for its reply from now on."""
        self.sock.settimeout(seconds)

    def close(self) -> None:
        self.sock.close()

