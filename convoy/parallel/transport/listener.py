"""A role service's end: accepts connections, admits a caller once it has proven it holds the job's secret (and
is not a stale incarnation), then answers each message with the handler's reply, one thread per connection (its
tensors in the connection's shared-memory lane, lane.py, when the caller opened one). A caller refused for any
reason gets one ``error`` reply naming why, and its connection is closed; every other connection goes on."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from convoy.errors import ConvoyError
from convoy.parallel.transport.connection import tune
from convoy.parallel.transport.errors import Refused, TransportError
from convoy.parallel.transport.handshake import Admit, Credentials, Identity, service_handshake
from convoy.parallel.transport.lane import OPEN, OPENED, REFUSED, Lane, LaneRefused, lane_in, lane_out
from convoy.parallel.transport.tls import service_context
from convoy.parallel.transport.wire import Limits, Message, recv_message, send_message

Handler = Callable[[Message, Identity], Message]
"""A message and the caller it came from -> the reply."""
HANDSHAKE_S = 10.0
"""How long a new connection has to prove itself."""
MAX_CONNECTIONS = 1024
DRAIN_S, DRAIN_BYTES = 1.0, 16 << 20
"""After a refusal: how long, and how much of what the caller still sends, is read and dropped before the close
(closing with unread bytes resets the connection, and the caller could lose the reply that says why)."""
CLOSE_JOIN_S = 10.0


class Listener:
    """Serves ``handler`` on ``host:port`` (``""``: every interface, only when asked). A handler's ``Refused``
    closes that connection after its reply, any other ``ConvoyError`` is an ``error`` reply; ``replied`` (if given)
    sees each reply once it is sent (where a service learns that its goodbye went out)."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 replied: Callable[[Message], None] | None = None, *, credentials: Credentials | None = None,
                 admit: Admit | None = None, limits: Limits | None = None) -> None:
        self.handler, self.replied, self.admit = handler, replied, admit
        self.credentials = credentials or Credentials.from_env()
        self.limits = limits or Limits()
        self.tls, self.certificate = service_context() if self.credentials.tls else (None, b"")
        self.sock = socket.create_server((host, port))
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.closed = threading.Event()
        self.refused = 0
        """Connections and messages refused so far (each with its reply)."""
        self._lock = threading.Lock()
        self._open: dict[threading.Thread, socket.socket] = {}
        """Each connection's thread -> its socket (the TLS one, once wrapped): what ``close`` wakes."""
        self.accepter = threading.Thread(target=self._accept, name="service-accept", daemon=True)
        self.accepter.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                tune(conn)
            except OSError:  # reset by the peer already: nothing to serve
                conn.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), name="service-conn", daemon=True)
            with self._lock:
                full = len(self._open) >= MAX_CONNECTIONS
                if not full:
                    self._open[thread] = conn
            if full:
                conn.settimeout(DRAIN_S)
                self._refuse(conn, Refused(f"this service holds {MAX_CONNECTIONS} connections already; close some"),
                             drain=False)
                continue
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        stream, me = conn, threading.current_thread()
        try:
            conn.settimeout(HANDSHAKE_S)
            if self.tls is not None:
                stream = self.tls.wrap_socket(conn, server_side=True)
                with self._lock:
                    self._open[me] = stream
            caller = service_handshake(stream, self.credentials, self.certificate, self.admit)
            stream.settimeout(None)
            self._answer(stream, caller)
        except Refused as exc:
            self._refuse(stream, exc)
        except (TransportError, OSError):  # gone, timed out, or not TLS: nothing to answer
            pass
        finally:
            stream.close()
            with self._lock:
                self._open.pop(me, None)

    def _answer(self, stream: socket.socket, caller: Identity) -> None:
        """Each message's reply, until the caller leaves or is refused (``Refused`` raised); tensors through the
        connection's shared-memory lane once the caller has opened one."""
        lane: Lane | None = None
        try:
            while not self.closed.is_set():
                message = recv_message(stream, self.limits)
                if self.admit is not None:
                    self.admit(caller)  # a caller current at connect may have been replaced since
                if message.op == OPEN:
                    if lane is not None:
                        lane.close()
                    lane, reply = self._open_lane(message)
                else:
                    reply = lane_out(lane, self._reply(lane_in(lane, message, self.limits), caller))
                send_message(stream, reply)
                if self.replied is not None:
                    self.replied(reply)
        finally:
            if lane is not None:
                lane.close()

    def _open_lane(self, message: Message) -> tuple[Lane | None, Message]:
        try:
            lane = Lane.attach(message.meta, self.limits)
        except LaneRefused as exc:
            return None, Message(REFUSED, {"why": str(exc)})
        return lane, Message(OPENED, {"bytes": lane.size})

    def _reply(self, message: Message, caller: Identity) -> Message:
        try:
            return self.handler(message, caller)
        except Refused:
            raise
        except ConvoyError as exc:
            return Message("error", {"message": str(exc), "kind": type(exc).__name__})
        except (KeyError, TypeError, ValueError, IndexError) as exc:  # a request that lacks what its op needs
            why = f"op {message.op[:40]!r}: malformed request ({type(exc).__name__}: {str(exc)[:200]})"
            return Message("error", {"message": why, "kind": "ConfigError"})

    def _refuse(self, stream: socket.socket, why: Refused, drain: bool = True) -> None:
        """One reply naming why, then the close; ``drain``: after reading (and dropping) a bounded rest of what was
        sent first."""
        with self._lock:
            self.refused += 1
        try:
            send_message(stream, Message("error", {"message": str(why), "kind": type(why).__name__}))
            if drain:
                stream.settimeout(DRAIN_S)
                socket.socket.shutdown(stream, socket.SHUT_WR)
                deadline, dropped = time.monotonic() + DRAIN_S, 0
                while dropped < DRAIN_BYTES and time.monotonic() < deadline:
                    chunk = stream.recv(1 << 16)
                    if not chunk:
                        break
                    dropped += len(chunk)
        except OSError:
            pass  # gone already: the close below is all that is left
        finally:
            stream.close()

    def close(self) -> None:
        """Stop accepting, wake every connection's thread and wait for it: a thread left inside torch while the
        interpreter exits can abort the process."""
        self.closed.set()
        with self._lock:
            open_now = dict(self._open)
        for sock in (self.sock, *open_now.values()):
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the descriptor itself, under any TLS layer
            except OSError:
                pass  # already closed by the peer
        self.sock.close()
        self.accepter.join(CLOSE_JOIN_S)
        for thread in open_now:
            if thread is not threading.current_thread():
                thread.join(CLOSE_JOIN_S)
