"""The dashboard's HTTP side: the front door's screen (login codes, cookies, the token) and a handler for its pages,
JSON, live stream and actions. The master's API server hands it every request outside ``/v1``; ``convoy dashboard``
runs it behind a front door of its own."""

from __future__ import annotations

import hmac
import http.client
import io
import json
import socket
import ssl
import urllib.parse
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Callable

from convoy.control.dashboard import views
from convoy.control.dashboard.actions import ActionError, Call, request_of, run_action
from convoy.control.dashboard.auth import CSRF_HEADER, Denied, Gate, Session, check_action, session_cookie
from convoy.control.dashboard.stream import Broadcaster
from convoy.control.limits import Limits, PrefixedReader, Screened, SocketWriter
from convoy.control.protocol import messages as p
from convoy.local_http import discard_body
from convoy.sanitize import printable

STATIC = Path(__file__).parent / "static"
ASSETS = {"index.html": "text/html", "app.js": "text/javascript", "chart.js": "text/javascript",
          "style.css": "text/css"}
PRIORITY = 2
"""After the agents' heartbeats (0) and their other calls (1)."""
MAX_BODY = 64 << 10
PAGES = ("overview", "nodes", "events", "metrics", "config", "rounds")
SECURITY_HEADERS = (("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
                    ("X-Frame-Options", "DENY"), ("Referrer-Policy", "no-referrer"),
                    ("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"))


@dataclass
class JobEntry:
    """One job the dashboard shows: its run dir, how its actions reach its master, its live heartbeat times."""

    key: str
    run_dir: Path
    call: Call | None = None
    last_seen: Callable[[], dict[str, float]] | None = None


class Dashboard:
    """The pages of one or more jobs behind one login gate. ``token``: the job's bearer token is taken too (for
    scripts and for minting new login links with ``POST /ui/code``); '' takes only sessions."""

    def __init__(self, jobs: list[JobEntry], token: str = "", tls: bool = False, limits: Limits | None = None) -> None:
        self.jobs = {job.key: job for job in jobs}
        self.token, self.tls, self.limits = token, tls, limits or Limits()
        self.gate = Gate()
        self.broadcaster = Broadcaster(lambda key: self.jobs[key].run_dir)
        self.single = len(jobs) == 1 and token != ""

    def login_link(self, host: str, port: int) -> str:
        host = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{host}:{port}/?code={self.gate.new_code()}"

    def stop(self) -> None:
        self.broadcaster.stop()

    def authenticate(self, headers: Any) -> Session | None:
        """The request's session, or None for the job token; Denied (401) for neither."""
        scheme, _, token = headers.get(p.TOKEN_HEADER, "").strip().partition(" ")
        if self.token and scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                             self.token.encode()):
            return None
        return self.gate.session(headers.get("Cookie", ""))

    def screen(self, head: bytes, client: str) -> Screened:
        """At the front door: a login code becomes a session (303 to the page, the code gone from the URL); a
        request with neither session nor token is refused before it costs a thread."""
        line, _, rest = head.partition(b"\n")
        try:
            method, target, _version = line.decode("latin-1").split()
            headers = http.client.parse_headers(io.BytesIO(rest.lstrip(b"\r")))
        except (ValueError, http.client.HTTPException):
            return whole_reply(400, "malformed request line or headers")
        path, _, query = target.partition("?")
        code = urllib.parse.parse_qs(query).get("code", [""])[0] if path == "/" else ""
        if code:
            try:
                session = self.gate.login(code, client)
            except Denied as exc:
                return whole_reply(exc.code, exc.reason, html=True)
            return whole_reply(303, "", extra=(("Location", "/"), ("Set-Cookie", session_cookie(session, self.tls))))
        try:
            self.authenticate(headers)
        except Denied as exc:
            return whole_reply(exc.code, exc.reason, html=method == "GET" and path == "/")
        return PRIORITY

    def serve(self, item: object) -> None:
        sock, client, *_ = item  # type: ignore[misc]
        handler: _Handler | None = None
        try:
            handler = _Handler(item, client, self)  # type: ignore[arg-type]
        except (ConnectionError, TimeoutError, ssl.SSLError):
            pass  # the browser went away mid-request
        finally:
            if handler is None or not handler.detached:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def index(self) -> list[dict[str, Any]]:
        out = []
        for job in self.jobs.values():
            problem = views.not_a_job(job.run_dir)
            out.append({"key": job.key, "run_dir": str(job.run_dir), "problem": problem,
                        "overview": None if problem else views.overview(job.run_dir)})
        return out

    def page(self, job: JobEntry, name: str, query: dict[str, str]) -> dict[str, Any]:
        run_dir = job.run_dir
        if name == "overview":
            return views.overview(run_dir)
        if name == "nodes":
            seen = job.last_seen() if job.last_seen else None
            return views.nodes(run_dir, seen, offset=max(0, _whole(query, "offset", 0)),
                               limit=max(1, min(_whole(query, "limit", views.NODES_PAGE), views.NODES_PAGE)))
        if name == "events":
            return views.events(run_dir, after=_whole(query, "after", 0), kind=query.get("kind", ""),
                                text=query.get("q", ""), limit=_whole(query, "limit", 500))
        if name == "metrics":
            upto = query.get("upto")
            return views.metrics(run_dir, after=_whole(query, "after", 0), upto=None if upto is None else
                                 _whole(query, "upto", 0))
        if name == "config":
            return views.config(run_dir)
        return views.rounds(run_dir)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    dashboard: Dashboard

    def __init__(self, item: Any, client: Any, dashboard: Dashboard) -> None:
        self.dashboard, self.detached = dashboard, False
        super().__init__(item, client, None)  # type: ignore[arg-type]

    def version_string(self) -> str:
        return "convoy"

    def setup(self) -> None:
        sock, _, prefix, _ = self.request
        self.connection = sock
        sock.settimeout(self.dashboard.limits.idle_timeout_s)
        self.rfile = io.BufferedReader(PrefixedReader(sock, prefix))
        self.wfile = SocketWriter(sock)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """Page requests are not logged."""

    def do_GET(self) -> None:  # noqa: N802
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def _handle(self, method: str) -> None:
        path, _, raw_query = self.path.partition("?")
        query = dict(urllib.parse.parse_qsl(raw_query))
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True
            discard_body(self.connection, self.rfile, max(length, 0))
            return self._json(413 if length > MAX_BODY else 400, {"error": f"body must be 0..{MAX_BODY} bytes"})
        body = self.rfile.read(length) if length else b""
        try:
            session = self.dashboard.authenticate(self.headers)
        except Denied as exc:
            self.close_connection = True
            return self._json(exc.code, {"error": exc.reason})
        try:
            if method == "GET":
                return self._get(path, query, session)
            return self._post(path, body, session)
        except ActionError as exc:
            return self._json(exc.code, {"error": exc.reason})
        except Denied as exc:
            return self._json(exc.code, {"error": exc.reason})

    def _get(self, path: str, query: dict[str, str], session: Session | None) -> None:
        dashboard = self.dashboard
        if path in ("/", "/index.html"):
            return self._asset("index.html")
        if path.startswith("/static/"):
            return self._asset(path.removeprefix("/static/"))
        if path == "/ui/api/session":
            return self._json(200, {"csrf": session.csrf if session else "", "who": session.who if session else
                                    "job token", "single": dashboard.single, "jobs": dashboard.index()})
        if path == "/ui/api/jobs":
            return self._json(200, {"jobs": dashboard.index()})
        if path == "/ui/stream":
            return self._stream(query)
        parts = path.removeprefix("/ui/api/jobs/").split("/")
        if path.startswith("/ui/api/jobs/") and len(parts) == 2:
            job = self._job(parts[0])
            if parts[1] not in PAGES:
                raise ActionError(404, f"no page {printable(parts[1][:40])!r}: one of {', '.join(PAGES)}")
            return self._json(200, dashboard.page(job, parts[1], query))
        raise ActionError(404, f"no such page {printable(path[:100])}" + (
            " (the API answers on a connection of its own)" if path.startswith(p.API_PREFIX) else ""))

    def _post(self, path: str, body: bytes, session: Session | None) -> None:
        if path == "/ui/code":
            if session is not None:
                raise Denied(403, "a new login link takes the job token (Authorization: Bearer), not a session")
            host = self.headers.get("Host", "")
            return self._json(200, {"url": f"{'https' if self.dashboard.tls else 'http'}://{host}/?code="
                                           f"{self.dashboard.gate.new_code()}"})
        parts = path.removeprefix("/ui/api/jobs/").split("/")
        if not path.startswith("/ui/api/jobs/") or len(parts) not in (2, 4):
            raise ActionError(404, f"no such action {printable(path[:100])}")
        check_action(session, self.headers.get("Origin", ""), self.headers.get("Host", ""),
                     self.headers.get(CSRF_HEADER, ""), self.dashboard.tls)
        job = self._job(parts[0])
        if job.call is None:
            raise ActionError(409, f"job {job.key} takes no actions from here")
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            raise ActionError(400, "the body is not JSON") from None
        if not isinstance(data, dict):
            raise ActionError(400, "the body is not a JSON object")
        who = session.who if session else f"job token from {self.client_address[0]}"
        if len(parts) == 4:
            if parts[1] != "proposals" or not parts[2].isdigit():
                raise ActionError(404, f"no such action {printable(path[:100])}")
            api_path, request = request_of(parts[3], data, who, int(parts[2]))
        else:
            api_path, request = request_of(parts[1], data, who)
        reply = run_action(job.call, api_path, request)
        self._json(200, {"ok": True, "reply": reply.model_dump() if hasattr(reply, "model_dump") else reply,
                         "overview": views.overview(job.run_dir)})  # the page shows it even if the master ends now

    def _job(self, key: str) -> JobEntry:
        job = self.dashboard.jobs.get(key)
        if job is None:
            raise ActionError(404, f"no job {printable(key[:40])!r} here: see the index")
        problem = views.not_a_job(job.run_dir)
        if problem:
            raise ActionError(404, f"not a job: {problem}")
        return job

    def _stream(self, query: dict[str, str]) -> None:
        job = self._job(query.get("job", ""))
        try:
            every = min(10.0, max(0.1, float(query.get("every", "0.25"))))
        except ValueError:
            raise ActionError(400, "every is a number of seconds (0.1..10)") from None
        broadcaster = self.dashboard.broadcaster
        if broadcaster.count >= broadcaster.max_streams:
            raise ActionError(503, f"{broadcaster.max_streams} live pages are open already: close one")
        self.send_response(200)
        for name, value in SECURITY_HEADERS:
            self.send_header(name, value)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.close_connection = True
        if broadcaster.add(self.connection, job.key, every):
            self.detached = True

    def _asset(self, name: str) -> None:
        if name not in ASSETS:
            raise ActionError(404, f"no asset {printable(name[:60])!r}")
        self._send(200, (STATIC / name).read_bytes(), f"{ASSETS[name]}; charset=utf-8")

    def _json(self, code: int, payload: dict[str, Any]) -> None:
        self._send(code, json.dumps(payload, separators=(",", ":"), allow_nan=False).encode(), "application/json")

    def _send(self, code: int, data: bytes, content_type: str) -> None:
        self.send_response(code)
        for name, value in SECURITY_HEADERS:
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)


def _whole(query: dict[str, str], name: str, default: int) -> int:
    try:
        return int(query.get(name, default))
    except ValueError:
        raise ActionError(400, f"{name} is a whole number (got {printable(query[name][:20])!r})") from None


def whole_reply(code: int, reason: str, html: bool = False, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole answer that closes the connection: JSON ``{"error": ...}``, or a short page for a browser."""
    if html:
        text = printable(reason).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        body = (f"<!doctype html><title>convoy dashboard: {code}</title><h1>{code} {HTTPStatus(code).phrase}</h1>"
                f"<p id=reason>{text}</p>").encode()
        kind = "text/html; charset=utf-8"
    else:
        body = json.dumps({"error": reason}).encode() if reason else b""
        kind = "application/json"
    lines = [f"HTTP/1.1 {code} {HTTPStatus(code).phrase}", "Server: convoy", f"Content-Type: {kind}",
             f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in SECURITY_HEADERS),
             *(f"{k}: {v}" for k, v in extra)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
