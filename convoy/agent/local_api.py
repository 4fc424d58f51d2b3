"""The agent's local API: how the processes of its node reach the control plane without the job's token.

A small threaded HTTP server on 127.0.0.1 (a free port), started once per agent; every process it starts gets
its address and a per-node random token (``CONVOY_AGENT_URL``, ``CONVOY_AGENT_TOKEN``). Each call is checked
(token in constant time, bounded body, a valid model), forwarded to the master with a client of the agent's own
(which holds the job token and retries), and answered with the master's reply or a JSON error. Its threads are
daemons with socket timeouts, so a stuck process never holds the agent.
"""

from __future__ import annotations

import hmac
import queue
import secrets
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from convoy import log
from convoy.control.protocol import messages as p
from convoy.control.protocol import roles as rp
from convoy.control.protocol import shards as sp
from convoy.control.protocol import training as tp
from convoy.errors import ConfigError, ConflictError, ConvoyError
from convoy.local_http import discard_body

AGENT_URL_ENV = "CONVOY_AGENT_URL"
AGENT_TOKEN_ENV = "CONVOY_AGENT_TOKEN"
MAX_BODY = 1 << 20
SOCKET_TIMEOUT_S = 60.0
"""A connection that sends nothing for this long is closed (longer than a forwarded call may take)."""
ROUTES: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/shards/declare": (sp.ShardDeclare, sp.ShardDeclared),
    "/shards/request": (sp.ShardRequest, sp.ShardGrant),
    "/shards/progress": (sp.ShardProgress, sp.ShardAck),
    "/shards/done": (sp.ShardDone, sp.ShardAck),
    "/train/declare": (tp.ConfigDeclare, tp.ConfigState),
    "/train/report": (tp.StatusReport, tp.StatusAck),
    "/roles/scale": (rp.RoleScale, rp.RolesView),
    "/roles/list": (rp.RolesQuery, rp.RolesView),
    "/groups/join": (rp.GroupJoin, rp.GroupView),
    "/groups/publish": (rp.GroupPublish, rp.GroupView),
}
"""Local path (under ``/v1``) -> (request, reply) models; the master serves the same path."""

Forward = Callable[[str, BaseModel, type[BaseModel]], BaseModel]
"""Send a request to the master's path, return its reply (raises ConvoyError, ConflictError for a 409)."""


class ClientPool:
    """Master clients for the server's threads (a client is not shared between threads; idle ones are kept)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def forward(self, path: str, request: BaseModel, reply: type[BaseModel]) -> BaseModel:
        try:
            client = self._idle.get_nowait()
        except queue.Empty:
            client = self._make()
        try:
            return client.call(path, request, reply)  # type: ignore[no-any-return]
        finally:
            self._idle.put(client)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S
    disable_nagle_algorithm = True  # headers and body go out as two writes: no wait for a delayed ACK between
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            return self._reply(400, "give the body's Content-Length (a whole number >= 0)")
        if length > MAX_BODY:
            self.close_connection = True
            self._reply(413, f"request body of {length} bytes is over the limit of {MAX_BODY}")
            return self._discard(length)
        body = self.rfile.read(length)
        given = self.headers.get(p.TOKEN_HEADER, "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.server.token}".encode()):
            return self._reply(401, f"missing or wrong agent token: send 'Authorization: Bearer ${AGENT_TOKEN_ENV}'")
        path = self.path.split("?", 1)[0]
        route = ROUTES.get(path.removeprefix(p.API_PREFIX)) if path.startswith(p.API_PREFIX) else None
        if route is None:
            return self._reply(404, f"no such endpoint {path} (there are: "
                                    f"{', '.join(p.API_PREFIX + known for known in ROUTES)})")
        model, reply_model = route
        try:
            request = model.model_validate_json(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "body"
            return self._reply(400, f"bad request to {path}: {where}: {first['msg']}")
        try:
            reply = self.server.forward(path.removeprefix(p.API_PREFIX), request, reply_model)
        except ConflictError as exc:
            return self._reply(409, exc.reason)
        except ConfigError as exc:  # the master found a value of the request wrong: the process must not retry
            return self._reply(400, str(exc))
        except ConvoyError as exc:  # the master is unreachable or failed the call: the process may retry
            return self._reply(502, f"the master did not answer {path}: {exc}")
        except Exception as exc:  # noqa: BLE001 (a fault caught on purpose: the agent keeps serving its node)
            log.warning(f"convoy agent: local API {path} failed: {type(exc).__name__}: {exc}")
            return self._reply(500, f"internal error in the agent's {path}: {type(exc).__name__}")
        self._send(200, reply.model_dump_json().encode())

    def _discard(self, length: int) -> None:
        discard_body(self.connection, self.rfile, length)

    def do_GET(self) -> None:  # noqa: N802
        self._reply(405, "the agent's local API takes POST")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (signature of the base class)
        """Calls are not logged: the master records what they changed."""

    def _reply(self, code: int, error: str) -> None:
        self._send(code, p.ErrorBody(error=error).model_dump_json().encode())

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    token: str
    forward: Forward

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A process that went away mid-call (killed) is not an error of the agent."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class LocalApi:
    """Serves the node's processes on a thread of its own; ``env()`` is what each process is given."""

    def __init__(self, forward: Forward, token: str | None = None, host: str = "127.0.0.1") -> None:
        self.token = token or secrets.token_urlsafe(24)
        self._server = _Server((host, 0), _Handler)
        self._server.token, self._server.forward = self.token, forward
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.2,), name="convoy-local-api",
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def env(self) -> dict[str, str]:
        return {AGENT_URL_ENV: self.url, AGENT_TOKEN_ENV: self.token}

    def start(self) -> LocalApi:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

