"""A caller's link to one role service: connect, prove who it is (handshake.py, over TLS where the job speaks
TLS), then one request and its reply at a time; their tensors in a shared-memory lane (lane.py) when asked for and
the service is on this host."""

from __future__ import annotations

import os
import socket
import ssl
import threading
from collections.abc import Mapping

import torch

from convoy.errors import ConfigError
from convoy.parallel.transport.errors import REFUSALS, ConnectionLost, Refused, TransportError
from convoy.parallel.transport.handshake import Credentials, Identity, caller_handshake
from convoy.parallel.transport.lane import LANE_META, MAX_LANE_BYTES, OPEN, OPENED, Lane, lane_in, lane_out, span
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
    agent's ``CONVOY_ROLE_SECRET``). Raises ``Refused`` when the service turns it away, or cannot prove itself.
    ``lane_bytes``: ask for a shared-memory lane of that size (grown up to 1 GiB to the largest message seen); a
    service on another host, or a full /dev/shm, leaves the tensors on the socket (``lane_why`` says why)."""

    def __init__(self, address: str, timeout: float = REQUEST_S, credentials: Credentials | None = None,
                 limits: Limits | None = None, service: str = "role service", lane_bytes: int = 0) -> None:
        self.address, self.service, self.lock = address, service, threading.Lock()
        self.lane: Lane | None = None
        self.lane_why = ""
        """Why there is no lane, or it stopped growing (empty while it is as wanted, or none was asked for)."""
        self.lane_wanted = lane_bytes
        """The lane's size to have before the next request (0: none)."""
        self.laned = 0
        """Messages (requests and replies) whose tensors went through the lane."""
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

    def request(self, message: Message, into: Mapping[str, torch.Tensor] | None = None) -> Message:
        """The service's reply to ``message``; its tensors go into ``into``'s where they fit (``recv_message``)."""
        with self.lock:
            try:
                self._fit_lane(span(message.tensors))
                sent = lane_out(self.lane, message)
                send_message(self.sock, sent)
                reply = recv_message(self.sock, self.limits, into)
                self.laned += (sent is not message) + (LANE_META in reply.meta)
                reply = lane_in(self.lane, reply, self.limits)
                if self.lane is not None and reply.tensors and span(reply.tensors) > self.lane.size:
                    self.lane_wanted = span(reply.tensors)  # it came on the socket: a larger lane for the next one
            except Refused as exc:  # a reply past this side's bounds
                self.close()
                raise type(exc)(f"the {self.service} at {self.address} sent a reply refused here: {exc}") from exc
            except (TransportError, OSError) as exc:
                raise ConnectionLost(f"the {self.service} at {self.address} went away: {exc}") from exc
        return self._unless_error(reply)

    def _unless_error(self, reply: Message) -> Message:
        """``reply``, or the error it carries raised (a refusal closes this end too: the service closed its own)."""
        if reply.op == "error":
            kind, text = str(reply.meta.get("kind")), reply.meta.get("message")
            if kind in REFUSALS:
                self.close()
                raise REFUSALS[kind](f"the {self.service} at {self.address} refused this process: {text}")
            error = ConfigError if kind == "ConfigError" else TransportError
            raise error(f"{self.service} at {self.address}: {text}")
        return reply

    def _fit_lane(self, needed: int) -> None:
        """Open (or grow) the lane to hold ``needed`` bytes, a power of two up to 1 GiB, when one is wanted and no
        earlier try settled that there is none. The service drops its lane before it maps a new one, so a refusal
        leaves neither side with one; a segment that cannot be made here (a full /dev/shm) keeps the one there is."""
        if not self.lane_wanted or self.lane_why:
            return
        needed = max(needed, self.lane_wanted)
        if self.lane is not None and self.lane.size >= needed or needed > MAX_LANE_BYTES:
            return
        size = 1 << (needed - 1).bit_length()
        try:
            lane, path, token = Lane.create(size, os.environ.get("CONVOY_JOB_ID"))
        except OSError as exc:
            self.lane_why = f"no segment of {size} bytes in /dev/shm ({exc.strerror})"
            return
        try:
            send_message(self.sock, Message(OPEN, {"path": str(path), "bytes": lane.size, "token": token.hex()}))
            reply = recv_message(self.sock, self.limits)
        except BaseException:
            lane.close()
            raise
        finally:
            path.unlink(missing_ok=True)  # both mappings outlive the name
        if self.lane is not None:
            self.lane.close()
        self.lane = lane if reply.op == OPENED else None
        if self.lane is None:
            lane.close()
            self._unless_error(reply)
            self.lane_why = str(reply.meta.get("why", f"answered {reply.op!r}"))

    def settimeout(self, seconds: float) -> None:
        """How long a request may wait for its reply from now on."""
        self.sock.settimeout(seconds)

    def close(self) -> None:
        self.sock.close()
        if self.lane is not None:
            self.lane.close()
            self.lane = None

