"""The master's HTTP API: a real threaded HTTP/1.1 server that feeds the calls of a ``Routed`` service
(``JobMaster`` is one; it composes this server, and this file does not know it)."""

from __future__ import annotations

import errno
import hmac
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Protocol

from pydantic import BaseModel, ValidationError

from convoy.control import protocol as p
from convoy.control import shard_protocol as sp
from convoy.control.replies import MAX_KEY_LENGTH, ReplyCache
from convoy.errors import ConfigError, ConflictError

MAX_BODY = 1 << 20
DISCARD_S = 2.0
"""How long a refused body is read and dropped before the connection closes."""
KEPT_STATUSES = (200, 409)
"""Answers a retry gets again; after a fault (500, 503) a retry runs the call again."""


# path -> (request model, reply model, summary); None: a GET without a body
ENDPOINTS: dict[str, tuple[type[BaseModel] | None, type[BaseModel] | None, str]] = {
    "/join": (p.JoinRequest, p.JoinResponse, "a node asks for a place in the next round"),
    "/wait": (p.WaitRequest, p.WaitResponse, "long poll until the node's round has closed"),
    "/heartbeat": (p.HeartbeatRequest, p.HeartbeatResponse, "check in; long poll for round or job changes"),
    "/worker_exit": (p.WorkerExit, p.Ack, "a worker failed"),
    "/event": (p.WorkerEvent, p.Ack, "a worker recorded an event"),
    "/node_done": (p.NodeDone, p.Ack, "all workers of a node finished"),
    "/leave": (p.LeaveRequest, p.Ack, "a node leaves the job"),
    "/role_report": (p.RoleReport, p.Ack, "a role process started (its address) or exited (its code)"),
    "/scale": (p.ScaleRequest, p.Ack, "run COUNT processes of a role (409 if the role cannot take it)"),
    "/memory": (p.MemoryReport, p.Ack, "a node's free memory and its role processes' peaks (a measured iteration)"),
    "/abort": (p.AbortRequest, p.Ack, "end the job as failed"),
    "/shards/declare": (sp.ShardDeclare, sp.ShardDeclared, "a worker declares a dataset (the first declaration wins)"),
    "/shards/request": (sp.ShardRequest, sp.ShardGrant, "a worker asks for a shard of a dataset"),
    "/shards/progress": (sp.ShardProgress, sp.ShardAck, "a worker trained its shard up to an item (409: not its)"),
    "/shards/done": (sp.ShardDone, sp.ShardAck, "a worker trained all of its shard (409: not its shard)"),
    "/status": (None, None, "the job's status"),
    "/openapi.json": (None, None, "this API's OpenAPI schema"),
}


SHARD_PATHS = ("/shards/declare", "/shards/request", "/shards/progress", "/shards/done")


class Routed(Protocol):
    """What the server needs of the service behind it: the calls it routes, and where it reports what it
    refused or could not do."""

    def join(self, req: p.JoinRequest) -> p.JoinResponse: ...
    def wait(self, req: p.WaitRequest) -> p.WaitResponse: ...
    def heartbeat(self, req: p.HeartbeatRequest) -> p.HeartbeatResponse: ...
    def worker_exit(self, report: p.WorkerExit) -> p.Ack: ...
    def worker_event(self, report: p.WorkerEvent) -> p.Ack: ...
    def node_done(self, req: p.NodeDone) -> p.Ack: ...
    def leave(self, req: p.LeaveRequest) -> p.Ack: ...
    def role_report(self, report: p.RoleReport) -> p.Ack: ...
    def scale(self, req: p.ScaleRequest) -> p.Ack: ...
    def memory_report(self, report: p.MemoryReport) -> p.Ack: ...
    def shard_call(self, req: sp.ShardWorker) -> Any: ...
    def abort(self, reason: str) -> None: ...
    def status(self) -> dict[str, Any]: ...
    def unauthorized(self, client: str, path: str) -> None: ...
    def api_fault(self, path: str, exc: BaseException) -> None: ...
    def take_unwritten(self) -> str | None:
        """Why the state of this thread's last call is not on disk (None: it is); asked once per call."""
    def state_fault(self) -> str | None:
        """Why the state cannot be written now (None: it can)."""
    def refused_for_disk(self) -> None: ...


def _routes(master: Routed) -> dict[str, tuple[type[BaseModel] | None, Callable[[Any], Any]]]:
    calls: dict[str, Callable[[Any], Any]] = {
        "/join": master.join, "/wait": master.wait, "/heartbeat": master.heartbeat,
        "/worker_exit": master.worker_exit, "/event": master.worker_event, "/node_done": master.node_done,
        "/leave": master.leave, "/role_report": master.role_report, "/scale": master.scale,
        "/memory": master.memory_report,
        "/abort": lambda req: master.abort(req.reason) or p.Ack(), "/status": lambda _: master.status(),
        "/openapi.json": lambda _: openapi_schema(),
        **{path: master.shard_call for path in SHARD_PATHS},
    }
    return {path: (ENDPOINTS[path][0], call) for path, call in calls.items()}


def openapi_schema() -> dict[str, Any]:
    """OpenAPI 3.1 description of the API, built from the wire models."""
    schemas: dict[str, Any] = {}

    def schema(model: type[BaseModel]) -> dict[str, Any]:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[model.__name__] = body
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"content": {"application/json": {"schema": schema(p.ErrorBody)}}}
    paths: dict[str, Any] = {}
    for path, (request, reply, summary) in ENDPOINTS.items():
        responses: dict[str, Any] = {"401": {"description": "missing or wrong token", **error}}
        ok_schema = schema(reply) if reply else {"type": "object"}
        ok = {"description": "ok", "content": {"application/json": {"schema": ok_schema}}}
        operation: dict[str, Any] = {"summary": summary, "responses": {"200": ok, **responses}}
        if request is None:
            paths[p.API_PREFIX + path] = {"get": operation}
            continue
        operation["parameters"] = [{"name": p.IDEMPOTENCY_HEADER, "in": "header", "required": False,
                                    "schema": {"type": "string", "maxLength": MAX_KEY_LENGTH},
                                    "description": "the same on each retry of one call: a repeat gets the first "
                                                   "answer"}]
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": schema(request)}}}
        operation["responses"].update({"400": {"description": "malformed request", **error},
                                       "409": {"description": "conflicts with the job's state", **error},
                                       "503": {"description": "handled, but the job's state cannot be written "
                                                              "(a full disk): retry", **error},
                                       "413": {"description": "body too large", **error}})
        paths[p.API_PREFIX + path] = {"post": operation}
    return {
        "openapi": "3.1.0",
        "info": {"title": "convoy master API", "version": "1"},
        "components": {"schemas": schemas, "securitySchemes": {"token": {"type": "http", "scheme": "bearer"}}},
        "security": [{"token": []}],
        "paths": paths,
    }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    """Headers and body go out as two writes; with Nagle on, the body waits for the client's delayed ACK."""
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._handle(with_body=False)

    def do_POST(self) -> None:  # noqa: N802
        self._handle(with_body=True)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (signature of the base class)
        """Requests are not logged: the job's events are the record."""

    def _handle(self, with_body: bool) -> None:
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
            return self._discard(length)
        body = self.rfile.read(length) if length else b""
        master = self.server.master
        if not self._authorized():
            master.unauthorized(self.client_address[0], self.path)
            return self._reply(401, p.ErrorBody(error="missing or wrong job token"))
        path = self.path.split("?", 1)[0]
        route = self.server.routes.get(path.removeprefix(p.API_PREFIX)) if path.startswith(p.API_PREFIX) else None
        if route is None:
            return self._reply(404, p.ErrorBody(error=f"no such endpoint {path}"))
        model, call = route
        try:
            request = model.model_validate_json(body or b"{}") if model and with_body else None
        except ValidationError as exc:
            return self._reply(400, p.ErrorBody(error=f"bad request to {path}: {exc.errors()[0]['msg']}"))
        if model is not None and request is None:
            return self._reply(405, p.ErrorBody(error=f"{path} takes POST"))
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
        code, data = self._call(path, call, request)
        unwritten = master.take_unwritten()
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

    def _call(self, path: str, call: Callable[[Any], Any], request: BaseModel | None) -> tuple[int, bytes]:
        master = self.server.master
        try:
            reply = call(request)
        except ConflictError as exc:
            return 409, _encode(p.ErrorBody(error=str(exc)))
        except Exception as exc:  # noqa: BLE001 (a fault caught on purpose: recorded, the master keeps serving)
            master.api_fault(path, exc)
            return 500, _encode(p.ErrorBody(error=f"internal error in {path}: {type(exc).__name__}"))
        return 200, _encode(reply)

    def _discard(self, length: int) -> None:
        """Read and drop a refused body (for a bounded time) before closing: closing with unread
        bytes resets the connection, and the client may lose the answer before it reads it."""
        deadline = time.monotonic() + DISCARD_S
        self.connection.settimeout(DISCARD_S)
        try:
            while length > 0 and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(length, 1 << 16))
                if not chunk:
                    return
                length -= len(chunk)
        except OSError:  # timed out or gone: the answer was sent, the connection closes anyway
            return

    def _authorized(self) -> bool:
        given = self.headers.get(p.TOKEN_HEADER, "")
        expected = f"Bearer {self.server.token}"
        return hmac.compare_digest(given.encode(), expected.encode())

    def _reply(self, code: int, payload: BaseModel | dict[str, Any]) -> None:
        self._send(code, _encode(payload))

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _encode(payload: BaseModel | dict[str, Any]) -> bytes:
    return payload.model_dump_json().encode() if isinstance(payload, BaseModel) else json.dumps(payload).encode()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-request (an agent killed in a long poll) is not an error."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)
    master: Routed
    token: str
    replies: ReplyCache
    routes: dict[str, tuple[type[BaseModel] | None, Callable[[Any], Any]]]


class ApiServer:
    """Binds the API (a clear ConfigError if the port is taken) and serves it on a thread."""

    def __init__(self, master: Routed, host: str, port: int, token: str) -> None:
        try:
            self._server = _Server((host, port), _Handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is already in use: pick another --port or 0 for any") from exc
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        self._server.master, self._server.token, self._server.routes = master, token, _routes(master)
        self._server.replies = ReplyCache()
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), name="convoy-api", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
