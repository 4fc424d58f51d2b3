"""Who may see the dashboard: one-time login codes, the sessions they open (an HttpOnly cookie), and the checks an
action must pass (the session's CSRF token, a same-origin request). Pure: no sockets, no threads of its own."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie

COOKIE = "convoy_session"
CSRF_HEADER = "X-Convoy-CSRF"
CODE_TTL_S = 24 * 3600.0
"""A login code not used within this long no longer opens a session."""
SESSION_TTL_S = 7 * 24 * 3600.0
MAX_SESSIONS = 256
"""Sessions kept; past it the oldest is forgotten (its browser logs in again)."""
MAX_CODES = 64


@dataclass
class Session:
    session_id: str
    csrf: str
    client: str
    created: float

    @property
    def who(self) -> str:
        """How an action of this session is named in the job's events (never the secret itself)."""
        digest = hashlib.sha256(self.session_id.encode()).hexdigest()[:8]
        return f"dashboard session {digest} from {self.client}"


class Denied(Exception):
    """A request the dashboard refuses: ``code`` is 401 or 403, the message says why and what to do."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class Gate:
    """Login codes and sessions of one dashboard; thread-safe (the front door and the handlers both ask)."""

    def __init__(self, clock: object = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._codes: dict[str, float] = {}
        self._used: set[str] = set()
        self._sessions: dict[str, Session] = {}

    def new_code(self) -> str:
        """A fresh one-time login code (the link printed at start carries one)."""
        code = secrets.token_urlsafe(18)
        with self._lock:
            if len(self._codes) >= MAX_CODES:
                self._codes.pop(next(iter(self._codes)))
            self._codes[code] = self._now()
        return code

    def login(self, code: str, client: str) -> Session:
        """Trade a login code for a session; a wrong, reused or expired code is a 401 that says which."""
        with self._lock:
            issued = self._codes.pop(code, None)
            if issued is None:
                if code in self._used:
                    raise Denied(401, "this login code was used already: each code opens one session; ask for a "
                                      "new link (convoy prints one at start; POST /ui/code with the job token)")
                raise Denied(401, "unknown login code: open the link convoy printed at start")
            if len(self._used) < 4 * MAX_CODES:
                self._used.add(code)
            if self._now() - issued > CODE_TTL_S:
                raise Denied(401, "this login code has expired: ask for a new link")
            session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(24), client, self._now())
            if len(self._sessions) >= MAX_SESSIONS:
                self._sessions.pop(next(iter(self._sessions)))
            self._sessions[session.session_id] = session
            return session

    def session(self, cookie_header: str) -> Session:
        """The session a request's Cookie header names; none, forged or expired is a 401."""
        session_id = cookie_value(cookie_header, COOKIE)
        if not session_id:
            raise Denied(401, "not logged in: open the login link convoy printed at start")
        with self._lock:
            found = next((s for key, s in self._sessions.items() if hmac.compare_digest(key, session_id)), None)
            if found is None:
                raise Denied(401, "unknown session cookie (forged, or from before a restart): open a new login link")
            if self._now() - found.created > SESSION_TTL_S:
                del self._sessions[found.session_id]
                raise Denied(401, "the session has expired: open a new login link")
            return found

    def _now(self) -> float:
        return float(self._clock())  # type: ignore[operator]


def cookie_value(header: str, name: str) -> str:
    try:
        jar = SimpleCookie(header)
    except CookieError:
        return ""
    morsel = jar.get(name)
    return morsel.value if morsel is not None else ""


def session_cookie(session: Session, secure: bool) -> str:
    """The Set-Cookie value: script cannot read it, no other site's request carries it."""
    flags = "; Secure" if secure else ""
    return f"{COOKIE}={session.session_id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={int(SESSION_TTL_S)}{flags}"


def check_action(session: Session | None, origin: str, host: str, csrf: str, tls: bool) -> None:
    """An action (abort, apply, scale) must come from this dashboard's own page: same origin and, for a cookie
    session, its CSRF token. A bearer-token client (``session`` None) is a script, not a browser: no check."""
    if session is None:
        return
    expected = f"{'https' if tls else 'http'}://{host}"
    if not origin:
        raise Denied(403, "cross-site check: an action needs an Origin header (send it from the dashboard's page)")
    if origin != expected:
        raise Denied(403, f"cross-site request refused: Origin {origin[:100]!r} is not this dashboard ({expected})")
    if not csrf or not hmac.compare_digest(csrf, session.csrf):
        raise Denied(403, f"missing or wrong {CSRF_HEADER} header: reload the dashboard's page")
