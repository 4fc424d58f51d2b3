"""The master's HTTP API: a real threaded HTTP/1.1 server that feeds the calls of a ``Routed`` service
(``JobMaster`` is one; it composes this server, and this file does not know it)."""

from __future__ import annotations

import hmac
import http.client
import io
import json
import socket
import ssl
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from convoy.control.limits import FrontDoor, Limits, Pages, PrefixedReader, Screened, SocketWriter, plain_reply
from convoy.control.protocol import messages as p
from convoy.control.protocol import roles as rp
from convoy.control.protocol import shards as sp
from convoy.control.protocol import training as tp
from convoy.control.replies import MAX_KEY_LENGTH, ReplyCache
from convoy.control.routed import Routed
from convoy.errors import ConfigError, ConflictError
from convoy.local_http import discard_body
from convoy.sanitize import printable

MAX_BODY = 1 << 20
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
    "/roles/scale": (rp.RoleScale, rp.RolesView, "a process of the job scales a role (convoy.scale; 409: refused)"),
    "/roles/list": (rp.RolesQuery, rp.RolesView, "a process of the job reads every role's counts (convoy.roles())"),
    "/groups/join": (rp.GroupJoin, rp.GroupView, "a process joins a group across roles (convoy.join_group)"),
    "/groups/publish": (rp.GroupPublish, rp.GroupView, "rank 0 of a group says where its store is (409: not rank 0)"),
    "/memory": (p.MemoryReport, p.Ack, "a node's free memory and its role processes' peaks (a measured iteration)"),
    "/abort": (p.AbortRequest, p.Ack, "end the job as failed"),
    "/shards/declare": (sp.ShardDeclare, sp.ShardDeclared, "a worker declares a dataset (the first declaration wins)"),
    "/shards/request": (sp.ShardRequest, sp.ShardGrant, "a worker asks for a shard of a dataset"),
    "/shards/progress": (sp.ShardProgress, sp.ShardAck, "a worker trained its shard up to an item (409: not its)"),
    "/shards/done": (sp.ShardDone, sp.ShardAck, "a worker trained all of its shard (409: not its shard)"),
    "/train/declare": (tp.ConfigDeclare, tp.ConfigState, "a worker declares its training config (the first wins)"),
    "/train/report": (tp.StatusReport, tp.StatusAck, "a worker's training status points (409: not the job's)"),
    "/config": (tp.ConfigSet, tp.VersionInfo, "PUT: set the training config (GET: the config, its versions and "
                                              "proposals)"),
    "/config/proposals": (tp.ProposalAction, tp.VersionInfo, "apply or dismiss a proposal of the status rules"),
    "/metrics": (None, None, "the ranks' training status: ?task=ROLE:RANK&since=STEP&limit=N"),
    "/status": (None, None, "the job's status"),
    "/openapi.json": (None, None, "this API's OpenAPI schema"),
}


SHARD_PATHS = ("/shards/declare", "/shards/request", "/shards/progress", "/shards/done")
READ_TOO = {"/config"}
"""Paths with a body that also answer a GET (without one)."""
PUT_PATHS = {"/config"}
"""Paths whose call is a PUT (a POST is taken too)."""


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
            if path == "/metrics":
                operation["parameters"] = [{"name": name, "in": "query", "required": False, "schema": {"type": kind}}
                                           for name, kind in (("task", "string"), ("since", "integer"),
                                                              ("limit", "integer"))]
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
        paths[p.API_PREFIX + path] = {"put" if path in PUT_PATHS else "post": operation}
        if path in READ_TOO:
            paths[p.API_PREFIX + path]["get"] = {"summary": summary, "responses": {
                "200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}},
                **responses}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "convoy master API", "version": "1"},
        "components": {"schemas": schemas, "securitySchemes": {"token": {"type": "http", "scheme": "bearer"}}},
        "security": [{"token": []}],
        "paths": paths,
    }


def bearer_token(header: str) -> str:
    """The token of an ``Authorization: Bearer TOKEN`` header (the scheme in any case), or ''."""
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def version_string(self) -> str:
        """The Server header names convoy only, not the Python it runs on."""
        return "convoy"

    def setup(self) -> None:
        sock, _, prefix = self.request
        self.connection = sock
        sock.settimeout(self.server.limits.idle_timeout_s)
        self.rfile = io.BufferedReader(PrefixedReader(sock, prefix))
        self.wfile = SocketWriter(sock)

    def handle_one_request(self) -> None:
        self.connection.settimeout(self.server.limits.idle_timeout_s)  # between requests of a keep-alive client
        super().handle_one_request()

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._handle(with_body=False)

    def do_POST(self) -> None:  # noqa: N802
        self._handle(with_body=True)

    def do_PUT(self) -> None:  # noqa: N802
        self._handle(with_body=True)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (signature of the base class)
        """Requests are not logged: the job's events are the record."""

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
        except ConfigError as exc:  # a value the request gave is wrong: it names the field
            return 400, _encode(p.ErrorBody(error=str(exc)))
        except Exception as exc:  # noqa: BLE001 (a fault caught on purpose: recorded, the master keeps serving)
            master.api_fault(path, exc)
            return 500, _encode(p.ErrorBody(error=f"internal error in {path}: {type(exc).__name__}"))
        if isinstance(reply, p.WaitResponse) and reply.state != "waiting":
            # the agent's next call on this connection comes when its round ends; held idle, it would keep one of
            # the handler threads that long (1024 agents kept every heartbeat from a thread after a round closed)
            self.close_connection = True
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
        self.send_response(code)
        if self.close_connection or self.server.crowded():  # (crowded: this thread goes to the requests waiting)
            self.close_connection = True
            self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _encode(payload: BaseModel | dict[str, Any]) -> bytes:
    return payload.model_dump_json().encode() if isinstance(payload, BaseModel) else json.dumps(payload).encode()


def authorized(header: str, token: str) -> bool:
    return hmac.compare_digest(bearer_token(header).encode(), token.encode())


def _is_api(head: bytes) -> bool:
    parts = head.split(b" ", 2)
    return len(parts) == 3 and (parts[1] == p.API_PREFIX.encode() or parts[1].startswith(p.API_PREFIX.encode() + b"/"))


class _Server:
    """What a handler reads of the server it serves."""

    def __init__(self, master: Routed, token: str, limits: Limits, pages: Pages | None = None) -> None:
        self.master, self.token, self.limits, self.routes = master, token, limits, _routes(master)
        self.replies = ReplyCache()
        self.front: FrontDoor | None = None
        self.pages = pages

    def crowded(self) -> bool:
        return bool(self.front.pool.waiting) if self.front is not None else False

    def screen(self, head: bytes, client: str) -> Screened:
        """Before any body is read or a thread is spent: refuse a malformed head or a missing token; put
        heartbeats (the nodes' leases) first."""
        line, _, rest = head.partition(b"\n")
        try:
            method, target, version = line.decode("latin-1").split()
            headers = http.client.parse_headers(io.BytesIO(rest.lstrip(b"\r")))
        except (ValueError, http.client.HTTPException):
            return plain_reply(400, "malformed request line or headers")
        if not version.startswith("HTTP/1."):
            return plain_reply(400, f"unsupported protocol {printable(version[:20])}")
        if self.pages is not None and not _is_api(head):
            return self.pages.screen(head, client)
        if not authorized(headers.get(p.TOKEN_HEADER, ""), self.token):
            self.master.unauthorized(client, printable(target[:200]))
            return plain_reply(401, "missing or wrong job token")
        return 0 if target == p.API_PREFIX + "/heartbeat" else 1

    def serve(self, item: object) -> None:
        sock, client, head = item  # type: ignore[misc]
        if self.pages is not None and not _is_api(head):
            return self.pages.serve(item)
        try:
            _Handler(item, client, self)  # type: ignore[arg-type]
        except (ConnectionError, TimeoutError, ssl.SSLError):
            pass  # a client that went away mid-request (an agent killed in a long poll) is not an error
        finally:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class ApiServer:
    """Binds the API (a clear ConfigError if the port is taken) and serves it on a thread."""

    def __init__(self, master: Routed, host: str, port: int, token: str, limits: Limits | None = None,
                 tls: ssl.SSLContext | None = None, pages: Pages | None = None,
                 listener: socket.socket | None = None) -> None:
        self._server = _Server(master, token, limits or Limits(), pages)
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
        self.front.start()

    def stop(self) -> None:
        self.front.stop()
