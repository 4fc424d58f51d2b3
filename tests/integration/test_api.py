"""The master's HTTP API, in process: a real JobMaster serving on 127.0.0.1, fake nodes as clients."""

from __future__ import annotations

import http.client
import json
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import wait_for

from convoy.config import MasterConfig, RendezvousConfig
from convoy.control.master import TOKEN_FILE, JobMaster
from convoy.control.protocol import messages as p
from convoy.control.protocol.client import MasterClient
from convoy.control.store import read_status
from convoy.errors import AuthError, ConvoyError


class Master:
    """A started JobMaster plus what it printed."""

    def __init__(self, run_dir: Path, **config: Any) -> None:
        rendezvous = config.pop("rendezvous", RendezvousConfig(2, 2, 0.0, 60.0))
        self.run_dir = run_dir
        self.config = MasterConfig(host="127.0.0.1", port=0, run_dir=run_dir, max_restarts=2,
                                   rendezvous=rendezvous, **config)
        self.config.validate()
        self.console: list[str] = []
        self.master = JobMaster(self.config, console=self.console.append)
        self.master.start()
        self.host, self.port = self.master.api.address

    def client(self, token: str | None = None) -> MasterClient:
        return MasterClient(self.host, self.port, self.master.token if token is None else token, 5.0)

    def raw(self, method: str, path: str, body: bytes | None = None, token: str | None = "",
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        """One request by hand; token '' means the job's token, None means no Authorization header."""
        all_headers = dict(headers or {})
        if token is not None:
            all_headers[p.TOKEN_HEADER] = f"Bearer {token or self.master.token}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=all_headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            conn.close()

    def event_kinds(self) -> list[str]:
        return [e["kind"] for e in read_status(self.run_dir, recent=1000)["events"]]


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    started = Master(tmp_path / "run")
    yield started
    started.master.stop()


def join(client: MasterClient, node_id: str, host: str, nproc: int = 2, port: int = 29500) -> int:
    request = p.JoinRequest(node_id=node_id, host=host, nproc=nproc, port=port)
    return client.call("/join", request, p.JoinResponse).round_id


def wait(client: MasterClient, node_id: str, round_id: int, timeout_s: float = 0.0) -> p.WaitResponse:
    return client.call("/wait", p.WaitRequest(node_id=node_id, round_id=round_id, timeout_s=timeout_s),
                       p.WaitResponse, wait_s=timeout_s)


def heartbeat(client: MasterClient, node_id: str, round_id: int, wait_s: float = 0.0) -> p.HeartbeatResponse:
    return client.call("/heartbeat", p.HeartbeatRequest(node_id=node_id, round_id=round_id, wait_s=wait_s),
                       p.HeartbeatResponse, wait_s=wait_s)


def test_token_file_holds_the_token_readable_by_the_owner_only(master: Master) -> None:
    path = master.run_dir / TOKEN_FILE
    assert path.read_text().strip() == master.master.token and len(master.master.token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("header", [None, "Bearer wrong-token", "", "Bearer", "TOKEN-WITHOUT-BEARER"])
def test_requests_without_the_right_token_get_401_and_are_recorded(master: Master, header: str | None) -> None:
    headers = {}
    if header is not None:
        headers[p.TOKEN_HEADER] = header if header != "TOKEN-WITHOUT-BEARER" else master.master.token
    body = p.JoinRequest(node_id="intruder", host="10.6.6.6", nproc=1, port=1).model_dump_json().encode()
    status, reply = master.raw("POST", "/v1/join", body, token=None, headers=headers)
    assert status == 401 and reply == {"error": "missing or wrong job token"}
    assert master.master.job.rendezvous.joined == [], "a rejected join must not register the node"
    assert "intruder" not in master.master.nodes.nodes
    events = read_status(master.run_dir)["events"]
    assert events[-1]["kind"] == "unauthorized" and "/v1/join" in events[-1]["message"]


def test_status_endpoint_also_needs_the_token(master: Master) -> None:
    status, _ = master.raw("GET", "/v1/status", token=None)
    assert status == 401
    status, reply = master.raw("GET", "/v1/status")
    assert status == 200
    assert reply["job_id"] == master.master.job.job_id and reply["status"] == "running" and reply["round_id"] == 1
    assert "unauthorized" in master.event_kinds()


def test_client_with_a_wrong_token_raises_auth_error(master: Master) -> None:
    with pytest.raises(AuthError, match="rejected the token"):
        join(master.client(token="not-the-token"), "a", "10.0.0.1")


@pytest.mark.parametrize(("body", "detail"), [
    (b"{not json", "bad request to /v1/join"),
    (b"", "bad request to /v1/join"),
    (b"[]", "bad request to /v1/join"),
    (b"null", "bad request to /v1/join"),
    (b'{"node_id": "a"}', "Field required"),
    (b'{"node_id": "a", "host": "h", "nproc": 0, "port": 1}', "greater than or equal to 1"),
    (b'{"node_id": "a", "host": "h", "nproc": "two", "port": 1}', "bad request"),
    (b"\xff\xfe\x00", "bad request"),
])
def test_malformed_bodies_get_400_and_change_nothing(master: Master, body: bytes, detail: str) -> None:
    status, reply = master.raw("POST", "/v1/join", body, headers={"Content-Type": "application/json"})
    assert status == 400, reply
    assert detail in reply["error"]
    assert master.master.job.rendezvous.joined == []
    status, _ = master.raw("POST", "/v1/heartbeat", b'{"node_id": "a", "round_id": "x"}')
    assert status == 400


def test_unknown_endpoint_wrong_method_and_oversized_body(master: Master) -> None:
    assert master.raw("POST", "/v1/nope", b"{}")[0] == 404
    assert master.raw("POST", "/join", b"{}")[0] == 404
    status, reply = master.raw("GET", "/v1/join")
    assert status == 405 and "takes POST" in reply["error"]
    with socket.create_connection((master.host, master.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/join HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n"
                     f"{p.TOKEN_HEADER}: Bearer {master.master.token}\r\n\r\n".encode())
        reply_bytes = sock.recv(4096)
    assert reply_bytes.startswith(b"HTTP/1.1 413"), reply_bytes


def test_an_oversized_body_without_the_token_is_401_and_recorded_unauthorized(master: Master) -> None:
    with socket.create_connection((master.host, master.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/join HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n")
        reply_bytes = sock.recv(4096)
    assert reply_bytes.startswith(b"HTTP/1.1 401"), reply_bytes
    wait_for(lambda: "unauthorized" in master.event_kinds(), 5, "the unauthorized event")


def test_join_wait_heartbeat_through_a_restart_to_success(master: Master) -> None:
    node_a, node_b = master.client(), master.client()
    assert join(node_a, "a", "10.0.0.1", port=1111) == 1
    assert wait(node_a, "a", 1).state == "waiting", "one of two nodes: the round stays open"

    assert join(node_b, "b", "10.0.0.2", port=2222) == 1
    ready_a, ready_b = wait(node_a, "a", 1), wait(node_b, "b", 1)
    assert ready_a.state == ready_b.state == "ready" and ready_a.round == ready_b.round
    info = ready_a.round
    assert info is not None
    assert (info.round_id, info.world_size, info.master_addr, info.master_port) == (1, 4, "10.0.0.1", 1111)
    assert [(m.node_id, m.node_rank, m.rank_offset) for m in info.members] == [("a", 0, 0), ("b", 1, 2)]
    assert (info.restart_count, info.max_restarts, info.job_id) == (0, 2, master.master.job.job_id)

    first = heartbeat(node_b, "b", 0)
    assert (first.job_status, first.round_id) == ("running", 1)

    # b long-polls on its own connection; a's failure report must wake it at once
    answers: list[p.HeartbeatResponse] = []
    poller = threading.Thread(target=lambda: answers.append(heartbeat(master.client(), "b", 1, wait_s=30.0)))
    poller.start()
    time.sleep(0.3)
    assert not answers, "nothing changed yet: the long poll holds its answer"
    report = p.WorkerExit(node_id="a", round_id=1, rank=1, local_rank=1, exitcode=3, log_path="/x/rank1.log",
                          log_tail=["boom"])
    assert node_a.call("/worker_exit", report, p.Ack).ok
    poller.join(timeout=10.0)
    assert not poller.is_alive() and answers and answers[0].round_id == 2, "the long poll answers the new round"

    assert wait(node_a, "a", 1).state == "rejoin"
    assert join(node_b, "b", "10.0.0.2", port=3333) == 2
    assert join(node_a, "a", "10.0.0.1", port=4444) == 2
    again = wait(node_a, "a", 2)
    assert again.state == "ready" and again.round is not None
    assert (again.round.round_id, again.round.restart_count, again.round.master_port) == (2, 1, 4444)
    assert [m.node_id for m in again.round.members] == ["a", "b"], "a keeps node rank 0"

    node_a.call("/node_done", p.NodeDone(node_id="a", round_id=2), p.Ack)
    assert heartbeat(node_b, "b", 2).job_status == "running"
    node_b.call("/node_done", p.NodeDone(node_id="b", round_id=2), p.Ack)
    final = heartbeat(node_b, "b", 2)
    assert final.job_status == "succeeded" and final.message == "job succeeded: all 4 workers finished"
    assert wait(node_a, "a", 2).state == "ended"
    assert master.master.wait_ended(1.0)

    kinds = master.event_kinds()
    assert kinds == ["master_started", "node_joined", "node_joined", "round_closed", "worker_failed", "restart",
                     "node_joined", "node_joined", "round_closed", "job_succeeded"]
    assert "convoy: rank 1 (node 0, local rank 1) exited with code 3 in round 1" in master.console
    assert "convoy: restart 1/2: opening round 2" in master.console


def test_a_waiting_node_is_answered_as_soon_as_the_round_closes(master: Master) -> None:
    node_a = master.client()
    join(node_a, "a", "10.0.0.1")
    answers: list[p.WaitResponse] = []
    waiter = threading.Thread(target=lambda: answers.append(wait(node_a, "a", 1, timeout_s=30.0)))
    waiter.start()
    time.sleep(0.3)
    assert not answers
    join(master.client(), "b", "10.0.0.2")
    waiter.join(timeout=10.0)
    assert answers and answers[0].state == "ready"


def test_a_node_joining_a_running_round_waits_for_the_next(master: Master) -> None:
    node_a, node_b, node_c = master.client(), master.client(), master.client()
    join(node_a, "a", "10.0.0.1")
    join(node_b, "b", "10.0.0.2")
    assert join(node_c, "c", "10.0.0.3") == 2
    assert wait(node_c, "c", 2).state == "waiting"


def test_leave_of_a_member_regroups_and_errors_reach_the_client(master: Master) -> None:
    node_a, node_b = master.client(), master.client()
    join(node_a, "a", "10.0.0.1")
    join(node_b, "b", "10.0.0.2")
    node_b.call("/leave", p.LeaveRequest(node_id="b", reason="interrupted by SIGINT"), p.Ack)
    job = master.master.job
    assert (job.round_id, job.restart_count, job.regroup_count) == (2, 0, 1)
    assert "convoy: node b left (interrupted by SIGINT): going on with 1 nodes (round 2)" in master.console
    assert master.master.nodes.nodes["b"].state == "left"
    with pytest.raises(ConvoyError, match="400"):
        node_a.call("/heartbeat", p.LeaveRequest(node_id="a"), p.Ack)  # lacks round_id


def test_a_silent_node_is_declared_lost(tmp_path: Path) -> None:
    started = Master(tmp_path / "run", heartbeat_s=0.05, heartbeat_timeout_s=0.3)
    try:
        join(started.client(), "a", "10.0.0.1")  # 1 of 2 nodes, then silence
        deadline = time.monotonic() + 10.0
        while "node_left" not in started.event_kinds() and time.monotonic() < deadline:
            time.sleep(0.05)
        events = read_status(started.run_dir)["events"]
        left = [e for e in events if e["kind"] == "node_left"]
        assert left and "node a sent no heartbeat" in left[0]["message"]
        assert started.master.job.rendezvous.joined == []
        assert started.master.nodes.nodes["a"].state == "lost"
    finally:
        started.master.stop()


def test_a_round_short_of_min_fails_the_job_after_the_join_timeout(tmp_path: Path) -> None:
    started = Master(tmp_path / "run", rendezvous=RendezvousConfig(2, 2, 0.0, 0.5))
    try:
        join(started.client(), "a", "10.0.0.1")
        assert started.master.wait_ended(10.0)
        assert started.master.job.status == "failed"
        assert "with 1 of at least 2 nodes" in started.master.job.outcome
        assert wait(started.client(), "a", 1).state == "ended"
        assert any("job failed: round 1 waited" in line for line in started.console)
    finally:
        started.master.stop()


def test_a_flood_of_bad_tokens_is_one_event_with_a_count(master: Master) -> None:
    for _ in range(40):
        status, _ = master.raw("GET", "/v1/status", token=None, headers={p.TOKEN_HEADER: "Bearer guess"})
        assert status == 401
    rejected = [e for e in read_status(master.run_dir)["events"] if e["kind"] == "unauthorized"]
    assert len(rejected) == 1, "every rejection is answered, but a flood must not flood the job's record"
    master.master._rejected["127.0.0.1"] = (time.monotonic() - 60.0, 39)  # as if the interval had passed
    master.raw("GET", "/v1/status", token=None)
    rejected = [e for e in read_status(master.run_dir)["events"] if e["kind"] == "unauthorized"]
    assert len(rejected) == 2 and "(39 more from it since the last record)" in rejected[-1]["message"]


def _worker_event(client: MasterClient, node_id: str, round_id: int, kind: str = "snapshot_skipped",
                  message: str = "no room in /dev/shm") -> p.Ack:
    event = p.WorkerEvent(node_id=node_id, round_id=round_id, rank=1, kind=kind, message=message)
    return client.call("/event", event, p.Ack)


def test_a_worker_event_is_recorded_with_its_rank_and_printed(master: Master) -> None:
    node_a = master.client()
    join(node_a, "a", "10.0.0.1")
    join(master.client(), "b", "10.0.0.2")
    assert _worker_event(node_a, "a", 1).ok
    events = read_status(master.run_dir)["events"]
    assert (events[-1]["kind"], events[-1]["message"]) == ("snapshot_skipped", "rank 1: no room in /dev/shm")
    assert (events[-1]["node_id"], events[-1]["round_id"]) == ("a", 1)
    assert "convoy: rank 1: no room in /dev/shm" in master.console
    assert "/v1/event" in master.raw("GET", "/v1/openapi.json")[1]["paths"]


def test_a_worker_event_from_an_old_round_is_a_stale_report(master: Master) -> None:
    node_a = master.client()
    join(node_a, "a", "10.0.0.1")
    join(master.client(), "b", "10.0.0.2")
    node_a.call("/worker_exit", p.WorkerExit(node_id="a", round_id=1, rank=0, local_rank=0, exitcode=1), p.Ack)
    _worker_event(node_a, "a", 1)
    events = read_status(master.run_dir)["events"]
    assert events[-1]["kind"] == "stale_report" and "round 1" in events[-1]["message"]
    assert "snapshot_skipped" not in master.event_kinds()


@pytest.mark.parametrize("kind", ["Bad", "1abc", "with space", "x" * 41, ""])
def test_a_worker_event_with_a_bad_kind_gets_400(master: Master, kind: str) -> None:
    body = json.dumps({"node_id": "a", "round_id": 1, "rank": 0, "kind": kind, "message": "m"}).encode()
    status, reply = master.raw("POST", "/v1/event", body)
    assert status == 400 and "bad request to /v1/event" in reply["error"]


def test_a_chatty_worker_cannot_flood_the_record(master: Master) -> None:
    node_a = master.client()
    join(node_a, "a", "10.0.0.1")
    join(master.client(), "b", "10.0.0.2")
    for index in range(50):
        assert _worker_event(node_a, "a", 1, kind="chatter", message=f"line {index}").ok
    recorded = [e for e in read_status(master.run_dir, recent=1000)["events"] if e["kind"] == "chatter"]
    assert 0 < len(recorded) <= 20, "every event is answered, but at most a budget of them per node is recorded"
    assert _worker_event(master.client(), "b", 1, kind="chatter", message="from b").ok, "b has its own budget"
    master.master._event_budgets["a"].window_start -= 60.0  # as if the window had passed
    _worker_event(node_a, "a", 1, kind="chatter", message="after the window")
    last = [e for e in read_status(master.run_dir, recent=1000)["events"] if e["node_id"] == "a"][-1]
    assert last["message"].startswith("rank 1: after the window")
    assert f"({50 - (len(recorded))} more from node a not recorded)" in last["message"]


def test_a_node_over_its_regroup_budget_is_refused_with_409_naming_it(tmp_path: Path) -> None:
    started = Master(tmp_path / "run", rendezvous=RendezvousConfig(1, 2, 0.0, 60.0), max_regroups=1)
    try:
        node_a, node_b = started.client(), started.client()
        join(node_a, "a", "10.0.0.1")
        join(node_b, "b", "10.0.0.2")
        node_b.call("/leave", p.LeaveRequest(node_id="b", reason="agent killed by SIGKILL"), p.Ack)  # regroup 1
        join(node_a, "a", "10.0.0.1")
        with pytest.raises(ConvoyError, match="409.*node b is excluded from job .*caused 2 regroups in 600 s"):
            join(node_b, "b", "10.0.0.2")
        assert started.master.job.round_id == 2 and started.master.job.membership is not None
        assert any("node b caused 2 regroups in 600 s (at most 1 allowed)" in line for line in started.console)
        with pytest.raises(ConvoyError, match="409.*--max-regroups"):
            join(started.client(), "b", "10.0.0.2")
        assert "node_excluded" in started.event_kinds() and "join_refused" in started.event_kinds()
    finally:
        started.master.stop()
