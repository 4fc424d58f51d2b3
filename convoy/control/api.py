"""The master's HTTP API: an HTTP/1.1 server (a front door loop, a bounded pool of handler threads, long polls parked
without a thread) that feeds the calls of a ``Routed`` service (``JobMaster`` is one; it composes this server, and
this file does not know it). Each request's handler answers one request; a keep-alive connection then goes back to
the front door."""

from __future__ import annotations

import gzip
import hmac
import io
import json
import socket
import ssl
import time
import urllib.parse
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from convoy.control.endpoints import ENDPOINTS, PUT_PATHS, READ_TOO, openapi_schema
from convoy.control.http_head import Head, parse_head, reply_head
from convoy.control.limits import (HEADER_END, FrontDoor, Limits, Pages, PrefixedReader, Screened, SocketWriter,
                                   close_connection, plain_reply, unread)
from convoy.control.long_polls import LongPoll, LongPolls
from convoy.control.protocol import messages as p
from convoy.control.replies import GZIP_AT, MAX_KEY_LENGTH, Encoded, ReplyCache
from convoy.control.routed import Routed
from convoy.errors import ConfigError, ConflictError
from convoy.local_http import discard_body
from convoy.sanitize import printable

MAX_BODY = 1 << 20
KEPT_STATUSES = (200, 409)
"""Answers a retry gets again; after a fault (500, 503) a retry runs the call again."""


SHARD_PATHS = ("/shards/declare", "/shards/request", "/shards/progress", "/shards/done")


def _routes(master: Routed) -> dict[str, tuple[type[BaseModel] | None, Callable[[Any], Any]]]:
    roles, train = master.role_calls, master.train_calls
    calls: dict[str, Callable[[Any], Any]] = {
        "/join": master.join, "/wait": master.wait, "/heartbeat": master.heartbeat,
        "/worker_exit": master.worker_exit, "/event": master.worker_event, "/node_done": master.node_done,
        "/leave": master.leave, "/role_report": roles.role_report, "/scale": roles.scale,
        "/roles/scale": roles.scale_from_job, "/roles/list": roles.roles_view,
        "/groups/join": roles.group_join, "/groups/publish": roles.group_publish,
        "/memory": roles.memory_report,
        "/abort": lambda req: master.abort(printable(req.reason)) or p.Ack(), "/status": lambda _: master.status(),
        "/openapi.json": lambda _: openapi_schema(),
        "/train/declare": train.train_declare, "/train/report": train.train_report,
        "/config": lambda req: train.config_get() if isinstance(req, dict) else train.config_set(req),
        "/config/proposals": train.proposal_action, "/metrics": train.metrics,
        **{path: roles.shard_call for path in SHARD_PATHS},
    }
    return {path: (ENDPOINTS[path][0], call) for path, call in calls.items()}


def bearer_token(header: str) -> str:
    """The token of an ``Authorization: Bearer TOKEN`` header (the scheme in any case), or ''."""
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class _Handler:
    """One request of a connection, from the head the front door read (the front door holds a keep-alive connection
    between requests); a long poll with nothing to say yet is ``parked``, and ``resume`` answers it later on any
    handler thread."""

    def __init__(self, item: tuple[socket.socket, tuple[str, int], bytes, Head], client: tuple[str, int],
                 server: _Server) -> None:
        sock, _, buffered, head = item
        self.connection, self.client_address, self.server, self.headers = sock, client, server, head
        self.path, self.close_connection = head.target, not head.keep_alive
        self.parked: tuple[LongPoll, str, str, str | None] | None = None
        """(the poll, its path, its idempotency key, why its state was not written when it was parked)."""
        sock.settimeout(server.limits.idle_timeout_s)
        body_at = HEADER_END.search(buffered)
        self.rfile = io.BufferedReader(PrefixedReader(sock, buffered[body_at.end():] if body_at else b""))
        self.wfile = SocketWriter(sock)

    def handle(self) -> None:
        method = self.headers.method
        if method in ("POST", "PUT"):
            return self._handle(with_body=True)
        if method == "GET":
            return self._handle(with_body=False)
        self.close_connection = True
        self._reply(501, p.ErrorBody(error=f"unsupported method {printable(method[:20])}"))

    def resume(self) -> None:
        """Answer the parked long poll (on a handler thread, once it is ready or due)."""
        assert self.parked is not None
        poll, path, key, unwritten = self.parked
        self.parked = None
        self.connection.settimeout(self.server.limits.idle_timeout_s)
        code, data = self._call(path, lambda _: poll.answer(), None)  # type: ignore[misc]
        self._done(key, code, data, unwritten)

    def _handle(self, with_body: bool) -> None:
        master = self.server.master
        if not self._authorized():  # from the headers: no body of a client without the token is read
            self.close_connection = True
            master.unauthorized(self.client_address[0], printable(self.path[:200]))
            self._reply(401, p.ErrorBody(error="missing or wrong job token"))
            return discard_body(self.connection, self.rfile, MAX_BODY)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            return self._reply(400, p.ErrorBody(error="Content-Length is not a whole number >= 0"))
        if length > MAX_BODY:
            self.close_connection = True
            self._reply(413, p.ErrorBody(error="request body too large"))
            return discard_body(self.connection, self.rfile, length)
        body = self._read_body(length)
        if body is None:
            self.close_connection = True
            return self._reply(408, p.ErrorBody(error=f"the body did not arrive within "
                                                      f"{self.server.limits.body_timeout_s:g} s"))
        path, _, query = self.path.partition("?")
        name = path.removeprefix(p.API_PREFIX)
        route = self.server.routes.get(name) if path.startswith(p.API_PREFIX) else None
        if route is None:
            return self._reply(404, p.ErrorBody(error=f"no such endpoint {path}"))
        model, call = route
        try:
            request = model.model_validate_json(body or b"{}", strict=True) if model and with_body else None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            return self._reply(400, p.ErrorBody(error=f"bad request to {path}: {where + ': ' if where else ''}"
                                                      f"{first['msg']}"))
        if model is not None and request is None and name not in READ_TOO:
            return self._reply(405, p.ErrorBody(error=f"{path} takes {'PUT' if name in PUT_PATHS else 'POST'}"))
        if request is None:
            request = dict(urllib.parse.parse_qsl(query)) if query else {}  # a GET: its query
        key = self.headers.get(p.IDEMPOTENCY_HEADER, "") if with_body else ""
        if len(key) > MAX_KEY_LENGTH:
            return self._reply(400, p.ErrorBody(error=f"{p.IDEMPOTENCY_HEADER} is longer than {MAX_KEY_LENGTH} "
                                                      "characters"))
        kept = self.server.replies.begin(key) if key else None
        if kept is not None:  # a retry of a call already handled: the same answer, handled once
            code, data, written = kept
            fault = None if written else master.state_fault()
            if fault is not None:
                return self._unwritten(fault)
            self.server.replies.mark_written(key)
            return self._send(code, data)
        outcome = self._call(path, call, request)
        if isinstance(outcome, LongPoll):  # this thread goes back to the pool; the poll is answered later
            self.parked = (outcome, path, key, master.take_unwritten())
            return
        self._done(key, *outcome)

    def _done(self, key: str, code: int, data: bytes, unwritten_before: str | None = None) -> None:
        unwritten = self.server.master.take_unwritten() or unwritten_before
        if key:
            self.server.replies.finish(key, code, data if code in KEPT_STATUSES else None, written=unwritten is None)
        if unwritten is not None and code == 200:
            return self._unwritten(unwritten)
        self._send(code, data)

    def _unwritten(self, reason: str) -> None:
        """The call was handled in memory, but its state is not on disk yet: the client retries it."""
        self.server.master.refused_for_disk()
        self._reply(503, p.ErrorBody(error=f"{reason}; the call was handled and is kept in memory: retry it (with "
                                           f"the same {p.IDEMPOTENCY_HEADER}) until the run dir's disk has room"))

    def _call(self, path: str, call: Callable[[Any], Any], request: BaseModel | None
              ) -> tuple[int, bytes] | LongPoll:
        master = self.server.master
        try:
            reply = call(request)
        except ConflictError as exc:
            return 409, _encode(p.ErrorBody(error=str(exc)))
        except ConfigError as exc:  # a value the request gave is wrong: it names the field
            return 400, _encode(p.ErrorBody(error=str(exc)))
        except Exception as exc:  # noqa: BLE001 (a fault caught on purpose: recorded, the master keeps serving)
            master.api_fault(path, exc)
            return 500, _encode(p.ErrorBody(error=f"internal error in {path}: {type(exc).__name__}"))
        if isinstance(reply, LongPoll):
            return reply
        return 200, _encode(reply)

    def _read_body(self, length: int) -> bytes | None:
        """The body, or None when it does not arrive in time (a slow client holds a thread that long at most)."""
        deadline = time.monotonic() + self.server.limits.body_timeout_s
        chunks, left = [], length
        try:
            while left > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self.connection.settimeout(remaining)
                chunk = self.rfile.read1(min(left, 1 << 16))
                if not chunk:
                    return None
                chunks.append(chunk)
                left -= len(chunk)
        except TimeoutError:
            return None
        return b"".join(chunks)

    def _authorized(self) -> bool:
        return authorized(self.headers.get(p.TOKEN_HEADER, ""), self.server.token)

    def _reply(self, code: int, payload: BaseModel | dict[str, Any]) -> None:
        self._send(code, _encode(payload))

    def _send(self, code: int, data: bytes) -> None:
        extra: tuple[tuple[str, str], ...] = (("Connection", "close"),) if self.close_connection else ()
        if len(data) >= GZIP_AT and "gzip" in self.headers.get("Accept-Encoding").lower():
            data = getattr(data, "gzipped", None) or gzip.compress(data, 1)  # (a round's: compressed once)
            extra += (("Content-Encoding", "gzip"),)
        self.wfile.write(reply_head(code, len(data), extra) + data)


def _encode(payload: BaseModel | dict[str, Any] | Encoded) -> bytes:
    if isinstance(payload, Encoded):
        return payload
    return payload.model_dump_json().encode() if isinstance(payload, BaseModel) else json.dumps(payload).encode()


def authorized(header: str, token: str) -> bool:
    return hmac.compare_digest(bearer_token(header).encode(), token.encode())


def _is_api(head: bytes) -> bool:
    parts = head.split(b" ", 2)
    return len(parts) == 3 and (parts[1] == p.API_PREFIX.encode() or parts[1].startswith(p.API_PREFIX.encode() + b"/"))


class _Server:
    """What a handler reads of the server it serves."""

    def __init__(self, master: Routed, token: str, limits: Limits, pages: Pages | None = None,
                 long_polls: LongPolls | None = None) -> None:
        self.master, self.token, self.limits, self.routes = master, token, limits, _routes(master)
        self.replies = ReplyCache()
        self.front: FrontDoor | None = None
        self.pages = pages
        self.long_polls = long_polls
        """Where long polls wait without a thread (None: a long poll is answered at once)."""

    def screen(self, head: bytes, client: str) -> Screened:
        """Before any body is read or a thread is spent: refuse a malformed head or a missing token; put
        heartbeats (the nodes' leases) first."""
        try:
            parsed = parse_head(head)
        except ValueError:
            return plain_reply(400, "malformed request line or headers")
        if not parsed.version.startswith("HTTP/1."):
            return plain_reply(400, f"unsupported protocol {printable(parsed.version[:20])}")
        if self.pages is not None and not _is_api(head):
            return self.pages.screen(head, client)
        if not authorized(parsed.get(p.TOKEN_HEADER), self.token):
            self.master.unauthorized(client, printable(parsed.target[:200]))
            return plain_reply(401, "missing or wrong job token")
        return 0 if parsed.target == p.API_PREFIX + "/heartbeat" else 1, parsed

    def serve(self, item: object) -> None:
        """A request the front door screened, or a parked long poll that is due (its handler)."""
        if isinstance(item, _Handler):
            handler = item
        else:
            _, client, _, parsed = item  # type: ignore[misc]
            if not isinstance(parsed, Head):  # (what the pages' screen admitted)
                return self.pages.serve(item)  # type: ignore[union-attr]
            handler = _Handler(item, client, self)  # type: ignore[arg-type]
        try:
            handler.resume() if handler.parked is not None else handler.handle()
            if handler.parked is not None:
                return self._park(handler)
            if not handler.close_connection:  # the front door watches it for the next request
                assert self.front is not None
                return self.front.readmit(handler.connection, handler.client_address,
                                          unread(handler.rfile, handler.connection))
        except (OSError, ssl.SSLError):
            pass  # a client that went away mid-request (an agent killed in a long poll) is not an error
        close_connection(handler.connection)

    def _park(self, handler: _Handler) -> None:
        assert handler.parked is not None and self.front is not None
        poll, pool = handler.parked[0], self.front.pool
        if self.long_polls is None:
            return self.serve(handler)
        self.long_polls.park(poll, lambda: pool.submit(poll.priority, handler))


class ApiServer:
    """Binds the API (a clear ConfigError if the port is taken) and serves it on a thread."""

    def __init__(self, master: Routed, host: str, port: int, token: str, limits: Limits | None = None,
                 tls: ssl.SSLContext | None = None, pages: Pages | None = None,
                 listener: socket.socket | None = None, long_polls: LongPolls | None = None) -> None:
        self._server = _Server(master, token, limits or Limits(), pages, long_polls)
        self.long_polls = long_polls
        self.front = FrontDoor(host, port, self._server.limits, self._server.screen, self._server.serve, tls,
                               listener)
        self._server.front = self.front

    @property
    def address(self) -> tuple[str, int]:
        return self.front.address

    @property
    def routes(self) -> dict[str, tuple[type[BaseModel] | None, Callable[[Any], Any]]]:
        return self._server.routes  # the dashboard's actions call them in the master's process

    def start(self) -> None:
        if self.long_polls is not None:
            self.long_polls.start()
        self.front.start()

    def stop(self) -> None:
        if self.long_polls is not None:
            self.long_polls.stop()  # the parked polls are answered, then the connections close
        self.front.stop()
