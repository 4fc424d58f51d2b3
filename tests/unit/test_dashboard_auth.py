"""The dashboard's gate: a login code opens one session once; cookies are checked; actions need the page's
origin and CSRF token; an action's body becomes the API call it is, or a 400 that names the field."""

from __future__ import annotations

import pytest

from convoy.control.dashboard.actions import ActionError, request_of
from convoy.control.dashboard.auth import COOKIE, Denied, Gate, check_action, session_cookie


def test_a_code_opens_one_session_once_and_expires() -> None:
    now = [1000.0]
    gate = Gate(clock=lambda: now[0])
    code = gate.new_code()
    session = gate.login(code, "10.0.0.1")
    assert gate.session(f"{COOKIE}={session.session_id}") is session
    with pytest.raises(Denied, match="used already"):
        gate.login(code, "10.0.0.1")
    with pytest.raises(Denied, match="unknown login code"):
        gate.login("made-up", "10.0.0.1")
    late = gate.new_code()
    now[0] += 2 * 24 * 3600
    with pytest.raises(Denied, match="expired"):
        gate.login(late, "10.0.0.1")
    cookie = session_cookie(session, secure=False)
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie


def test_a_missing_or_forged_cookie_is_a_401() -> None:
    gate = Gate()
    for header in ("", f"{COOKIE}=forged", "garbage;;;="):
        with pytest.raises(Denied) as refused:
            gate.session(header)
        assert refused.value.code == 401


def test_an_action_needs_the_same_origin_and_the_csrf_token() -> None:
    gate = Gate()
    session = gate.login(gate.new_code(), "127.0.0.1")
    check_action(session, "http://127.0.0.1:8080", "127.0.0.1:8080", session.csrf, tls=False)
    check_action(None, "", "127.0.0.1:8080", "", tls=False)  # the job token: a script, no browser checks
    for origin, csrf, says in (("", session.csrf, "Origin header"), ("http://evil", session.csrf, "cross-site"),
                               ("https://127.0.0.1:8080", session.csrf, "cross-site"),
                               ("http://127.0.0.1:8080", "wrong", "CSRF")):
        with pytest.raises(Denied, match=says) as refused:
            check_action(session, origin, "127.0.0.1:8080", csrf, tls=False)
        assert refused.value.code == 403


def test_an_actions_body_becomes_its_api_call_naming_who() -> None:
    path, request = request_of("abort", {"reason": "enough"}, "me")
    assert path == "/abort" and request.reason == "aborted from the dashboard by me: enough"
    path, request = request_of("apply", {}, "me", proposal=3)
    assert path == "/config/proposals" and (request.proposal, request.author) == (3, "me")
    path, request = request_of("scale", {"role": "worker", "count": 4}, "me")
    assert path == "/scale" and (request.role, request.count, request.author) == ("worker", 4, "me")
    for action, body, code in (("scale", {"role": "worker", "count": "4"}, 400), ("scale", {"count": 2}, 400),
                               ("explode", {}, 404)):
        with pytest.raises(ActionError) as refused:
            request_of(action, body, "me")
        assert refused.value.code == code
