"""No request crashes the master: malformed input gets a 4xx with a reason (fuzzed with hypothesis)."""

from __future__ import annotations

import http.client
import json
import socket
import string
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convoy.config import MasterConfig, RendezvousConfig
from convoy.control.endpoints import ENDPOINTS
from convoy.control.master import JobMaster
from convoy.control.protocol import messages as p
from convoy.control.store import read_status

FIELDS = sorted({name for model, _, _ in ENDPOINTS.values() if model for name in model.model_fields})
NUMBERS = st.one_of(st.integers(-3, 3), st.integers(-(2**70), 2**70), st.floats(-1, 1), st.just(float("nan")))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=40))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)
OBJECTS = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=8)
BODIES = st.one_of(OBJECTS.map(lambda obj: json.dumps(obj).encode()), JSON.map(lambda v: json.dumps(v).encode()),
                   st.binary(max_size=300))
URL_CHARS = string.ascii_letters + string.digits + "/_.-?=&%~"
PATHS = st.one_of(st.sampled_from([p.API_PREFIX + path for path in ENDPOINTS]),
                  st.text(alphabet=URL_CHARS, max_size=20).map(lambda t: "/" + t))
ALLOWED = {200, 400, 401, 404, 405, 409, 413}


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobMaster]:
    run_dir: Path = tmp_path_factory.mktemp("fuzz") / "run"
    config = MasterConfig(host="127.0.0.1", port=0, run_dir=run_dir, rendezvous=RendezvousConfig(2, 2, 0.0, 600.0))
    config.validate()
    master = JobMaster(config, console=lambda line: None)
    master.start()
    yield master
    master.stop()


def _request(master: JobMaster, method: str, path: str, body: bytes, token: str | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
    host, port = master.api.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        sent = {p.TOKEN_HEADER: f"Bearer {master.token if token is None else token}", **(headers or {})}
        if "Content-Length" in sent:
            conn.putrequest(method, path)
            for name, value in sent.items():
                conn.putheader(name, value)
            conn.endheaders()
            conn.send(body)
        else:
            conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        data = response.read()
        if data and response.getheader("Content-Type", "").startswith("text/html"):  # the dashboard's page
            text = data.decode()
            reason = text.partition("<p id=reason>")[2].partition("<")[0]
            return response.status, {"error": reason} if response.status != 200 else {"page": text}
        return response.status, json.loads(data) if data else None
    finally:
        conn.close()


def _still_serving(master: JobMaster) -> None:
    status, body = _request(master, "GET", p.API_PREFIX + "/status", b"")
    assert status == 200 and body["status"] == "running"


def _limit_waits(body: bytes) -> bytes:
    """Long polls may hold a request up to 60 s: keep fuzzed waits short so the test stays fast."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if isinstance(obj, dict):
        for key in ("wait_s", "timeout_s"):
            if isinstance(obj.get(key), (int, float)) and obj[key] == obj[key]:
                obj[key] = max(min(obj[key], 0.05), -1)
        return json.dumps(obj).encode()
    return body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=PATHS, body=BODIES, method=st.sampled_from(["POST", "GET"]), good_token=st.booleans())
def test_fuzzed_requests_get_an_answer_and_never_break_the_master(master: JobMaster, path: str, body: bytes,
                                                                   method: str, good_token: bool) -> None:
    status, reply = _request(master, method, path, _limit_waits(body), token=None if good_token else "wrong")
    assert status in ALLOWED, (status, reply)
    if status != 200:
        assert reply and reply["error"], "a refusal must say why"
    if not good_token:
        assert status == 401


def test_fuzzing_left_the_master_serving_with_no_internal_errors(master: JobMaster) -> None:
    _still_serving(master)
    kinds = [event["kind"] for event in read_status(master.config.run_dir, recent=100000)["events"]]
    assert "api_error" not in kinds
    assert "unauthorized" in kinds


@pytest.mark.parametrize(("body", "headers", "status"), [
    (b"{not json", {}, 400),
    (json.dumps({"node_id": "n", "host": "h", "nproc": 0, "port": 1000}).encode(), {}, 400),
    (json.dumps({"node_id": "n", "host": "h", "nproc": 1, "port": 1000, "extra": [1] * 10}).encode(), {}, 200),
    (b"x" * (2 << 20), {}, 413),
    (b"{}", {"Content-Length": "-5"}, 400),
    (b"{}", {"Content-Length": "abc"}, 400),
])
def test_bad_joins_get_a_reason(master: JobMaster, body: bytes, headers: dict[str, str], status: int) -> None:
    got, reply = _request(master, "POST", p.API_PREFIX + "/join", body, headers=headers)
    assert got == status, reply
    if status != 200:
        assert reply["error"]
    _still_serving(master)


def test_a_second_live_agent_with_the_same_node_id_is_refused(master: JobMaster) -> None:
    join = {"node_id": "twin", "host": "127.0.0.1", "nproc": 1, "port": 2000}
    assert _request(master, "POST", p.API_PREFIX + "/join", json.dumps({**join, "instance": "a"}).encode())[0] == 200
    status, reply = _request(master, "POST", p.API_PREFIX + "/join", json.dumps({**join, "instance": "b"}).encode())
    assert status == 409 and "in use by another running agent" in reply["error"]
    # the same agent joining again (e.g. after a rejoin) is fine
    assert _request(master, "POST", p.API_PREFIX + "/join", json.dumps({**join, "instance": "a"}).encode())[0] == 200


def test_openapi_schema_is_served_and_describes_every_endpoint(master: JobMaster) -> None:
    status, schema = _request(master, "GET", p.API_PREFIX + "/openapi.json", b"")
    assert status == 200 and schema["openapi"].startswith("3.")
    assert set(schema["paths"]) == {p.API_PREFIX + path for path in ENDPOINTS}
    join = schema["paths"][p.API_PREFIX + "/join"]["post"]
    ref = join["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]["nproc"]["minimum"] == 1
    assert _request(master, "GET", p.API_PREFIX + "/openapi.json", b"", token="nope")[0] == 401


def test_an_oversize_body_sent_after_the_refusal_still_gets_the_answer(master: JobMaster) -> None:
    """The client writes its body only after the 413 is on its way: the master must not close
    (and so reset) the connection under it while it still sends."""
    host, port = master.api.address
    body = b"x" * (4 << 20)
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(f"POST {p.API_PREFIX}/join HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                     f"{p.TOKEN_HEADER}: Bearer {master.token}\r\n\r\n".encode())
        time.sleep(0.3)  # the master has read the headers and answered by now
        conn.sendall(body)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"request body too large" in answer, answer[:200]
    _still_serving(master)
