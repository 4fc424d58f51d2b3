"""The SQLite store and `convoy status` text, fed by a real Job driven through a restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convoy.control.job import Event, Job
from convoy.control.nodes import NodeRecord, NodeRegistry
from convoy.control.protocol.messages import WorkerExit
from convoy.control.rendezvous import Rendezvous
from convoy.control.status import format_status
from convoy.control.store import Store, read_status
from convoy.errors import ConfigError


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    store = Store(tmp_path)
    yield store
    store.close()


def job_through_a_restart(store: Store) -> tuple[Job, NodeRegistry]:
    job = Job("feedbeef", Rendezvous(2, 2, 0.0, opened_at=0.0), max_restarts=3, join_timeout_s=60.0)
    registry = NodeRegistry(timeout_s=30.0)
    url = "127.0.0.1:4000"
    store.save(job, [Event("master_started", "master listening on 127.0.0.1:4000")], url, [])
    for node_id, host, port in (("local0", "10.0.0.1", 1111), ("local1", "10.0.0.2", 2222)):
        registry.register(node_id, host, 2, now=0.0)
        _, events = job.join(node_id, host, 2, port, now=0.0)
        store.save(job, events, url, list(registry.nodes.values()))
    report = WorkerExit(node_id="local1", round_id=1, rank=3, local_rank=1, signal="SIGKILL")
    store.save(job, job.worker_exited(report, now=1.0), url, list(registry.nodes.values()))
    for node_id, host, port in (("local1", "10.0.0.2", 3333), ("local0", "10.0.0.1", 4444)):
        _, events = job.join(node_id, host, 2, port, now=2.0)
        store.save(job, events, url, list(registry.nodes.values()))
    return job, registry


def test_read_status_returns_job_round_nodes_and_events_in_order(store: Store, tmp_path: Path) -> None:
    job, _ = job_through_a_restart(store)
    state = read_status(tmp_path)
    assert state["job"]["job_id"] == "feedbeef" and state["job"]["status"] == "running"
    assert (state["job"]["round_id"], state["job"]["restart_count"], state["job"]["max_restarts"]) == (2, 1, 3)
    assert state["job"]["ended_at"] is None
    assert state["round"]["round_id"] == 2 and state["round"]["world_size"] == 4
    assert (state["round"]["master_addr"], state["round"]["master_port"]) == ("10.0.0.1", 4444)
    assert json.loads(state["round"]["members"]) == [[0, "local0", "10.0.0.1", 2], [1, "local1", "10.0.0.2", 2]]
    assert [(n["node_id"], n["node_rank"]) for n in state["nodes"]] == [("local0", 0), ("local1", 1)]
    assert [e["kind"] for e in state["events"]] == [
        "master_started", "node_joined", "node_joined", "round_closed", "worker_failed", "restart",
        "node_joined", "node_joined", "round_closed",
    ]
    assert state["events"][4]["message"] == "rank 3 (node 1, local rank 1) was killed by SIGKILL in round 1"


def test_end_of_job_is_recorded_and_created_at_kept(store: Store, tmp_path: Path) -> None:
    job, registry = job_through_a_restart(store)
    created = read_status(tmp_path)["job"]["created_at"]
    store.save(job, job.node_done("local0", 2), "127.0.0.1:4000", list(registry.nodes.values()))
    store.save(job, job.node_done("local1", 2), "127.0.0.1:4000", list(registry.nodes.values()))
    row = read_status(tmp_path)["job"]
    assert row["status"] == "succeeded" and row["outcome"] == "job succeeded: all 4 workers finished"
    assert row["created_at"] == created and row["ended_at"] >= created


def test_recent_limits_the_events_to_the_newest(store: Store, tmp_path: Path) -> None:
    job = Job("j", Rendezvous(1, 1, 0.0, opened_at=0.0), 0, 1.0)
    store.save(job, [Event("note", f"event {i}") for i in range(30)], "u", [])
    events = read_status(tmp_path, recent=5)["events"]
    assert [e["message"] for e in events] == [f"event {i}" for i in range(25, 30)]


def test_read_status_without_a_job_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no convoy job state in"):
        read_status(tmp_path / "nowhere")


def test_format_status_shows_job_round_nodes_and_events(store: Store, tmp_path: Path) -> None:
    job, registry = job_through_a_restart(store)
    text = format_status(read_status(tmp_path))
    lines = text.splitlines()
    assert lines[0] == "job feedbeef: running, round 2, restarts 1/3, nodes 2:2, master 127.0.0.1:4000"
    assert "round 2: world size 4, store 10.0.0.1:4444 [node0=10.0.0.1x2, node1=10.0.0.2x2]" in lines
    node_lines = lines[lines.index("nodes:") + 1: lines.index("recent events:")]
    assert len(node_lines) == 2
    assert node_lines[0].split()[:4] == ["local0", "rank", "0", "10.0.0.1"] and "alive" in node_lines[0]
    event_lines = lines[lines.index("recent events:") + 1:]
    assert any("worker_failed" in line and "killed by SIGKILL" in line for line in event_lines)
    assert any("restart" in line and "restart 1/3: opening round 2" in line for line in event_lines)


def test_format_status_shows_only_the_first_line_of_a_long_outcome(store: Store, tmp_path: Path) -> None:
    job = Job("j", Rendezvous(1, 1, 0.0, opened_at=0.0), 0, 1.0)
    job.join("n", "h", 1, 1, now=0.0)
    report = WorkerExit(node_id="n", round_id=1, rank=0, local_rank=0, exitcode=3, log_path="/l/rank0.log",
                        log_tail=["Traceback", "ValueError: bad"])
    store.save(job, job.worker_exited(report, now=1.0), "u", [])
    text = format_status(read_status(tmp_path))
    assert "  job failed: rank 0 (node 0, local rank 0) exited with code 3; no restarts left (0 of 0 used)" in text
    assert "ValueError: bad" not in text


def test_format_status_before_any_job_row() -> None:
    assert format_status({"job": None, "nodes": [], "round": None, "events": []}) == "no job recorded yet"


def test_excluded_nodes_and_port_retries_survive_a_master_restart(tmp_path: Path) -> None:
    from convoy.config import MasterConfig
    from convoy.control.store import restore

    store = Store(tmp_path, MasterConfig(run_dir=tmp_path).to_json())
    job = Job("feedbeef", Rendezvous(1, 2, 0.0, opened_at=0.0), max_restarts=3, join_timeout_s=60.0,
              excluded={"n1": "node n1 is excluded from job feedbeef: ..."}, port_retries=2)
    store.save(job, [], "127.0.0.1:4000", [])
    store.close()
    _, again, _ = restore(tmp_path, now=0.0)
    assert again.excluded == job.excluded and again.port_retries == 2
    assert again.refusal("n1") is not None, "a flapping node stays out after the master restarts"


def test_a_state_file_of_an_earlier_version_is_still_written_and_restored(tmp_path: Path) -> None:
    import sqlite3

    from convoy.config import MasterConfig
    from convoy.control.store import restore

    old = sqlite3.connect(tmp_path / "state.db")
    old.execute("CREATE TABLE job (job_id TEXT PRIMARY KEY, status TEXT, restart_count INTEGER, max_restarts INTEGER,"
                " round_id INTEGER, min_nodes INTEGER, max_nodes INTEGER, master_url TEXT, outcome TEXT,"
                " created_at REAL, ended_at REAL, regroup_count INTEGER, done_nodes TEXT, config TEXT)")
    old.commit()
    old.close()
    store = Store(tmp_path, MasterConfig(run_dir=tmp_path).to_json())
    job = Job("feedbeef", Rendezvous(1, 2, 0.0, opened_at=0.0), max_restarts=3, join_timeout_s=60.0)
    store.save(job, [], "127.0.0.1:4000", [])
    store.close()
    assert restore(tmp_path, now=0.0)[1].excluded == {}


def test_each_part_is_written_with_the_job_and_read_back_as_last_written(tmp_path: Path) -> None:
    import sqlite3

    from convoy.control.store import read_part

    store = Store(tmp_path)
    job = Job("feedbeef", Rendezvous(1, 2, 0.0, opened_at=0.0), max_restarts=3, join_timeout_s=60.0)
    roles = {"begun": False}
    store.parts["roles"] = lambda: json.dumps(roles)
    store.save(job, [], "127.0.0.1:4000", [])
    roles["begun"] = True
    store.save(job, [], "127.0.0.1:4000", [])
    store.close()
    assert json.loads(read_part(tmp_path, "roles") or "null") == {"begun": True}
    assert read_part(tmp_path, "shards") is None
    older = tmp_path / "older"
    older.mkdir()
    sqlite3.connect(older / "state.db").execute("CREATE TABLE job (job_id TEXT)").connection.close()
    assert read_part(older, "roles") is None, "a state file written before parts existed holds none"


def test_status_says_the_newest_snapshot_interval_even_once_it_left_the_recent_events(store: Store,
                                                                                       tmp_path: Path) -> None:
    job = Job("j", Rendezvous(1, 1, 0.0, opened_at=0.0), 0, 1.0)
    said = "rank 0: snapshots every {} step(s): ...; a failure may cost up to {} finished step(s)"
    store.save(job, [Event("snapshot_interval", said.format(3, 2)), Event("snapshot_interval", said.format(5, 4)),
                     *[Event("note", f"event {i}") for i in range(30)]], "u", [])
    state = read_status(tmp_path, recent=5)
    assert all(e["kind"] == "note" for e in state["events"])
    lines = format_status(state).splitlines()
    newest = [line for line in lines if "snapshots every" in line]
    assert len(newest) == 1 and newest[0].startswith(said.format(5, 4) + " (said "), lines
    assert "snapshots every" not in format_status({**state, "snapshot_interval": None}), "no budget: no line"


def test_lazy_parts_are_left_for_a_later_save_within_their_share_of_the_time(store: Store, tmp_path: Path) -> None:
    """A burst of changes a restarted master recovers without the parts (role starts) writes them now and then,
    at most ``PARTS_SHARE`` of the time; any other save writes them at once, with what the lazy ones left."""
    import time

    from convoy.control.store import read_part

    made = []

    def slow_part() -> str:  # ~20 ms to make: the next 200 ms of lazy saves leave it
        time.sleep(0.02)
        made.append(1)
        return json.dumps({"made": len(made)})

    store.parts["roles"] = slow_part
    job = Job("feedbeef", Rendezvous(1, 1, 0.0, opened_at=0.0), max_restarts=3, join_timeout_s=60.0)
    store.save(job, [Event("first", "")], "127.0.0.1:1", [], lazy_parts=True)
    assert read_part(tmp_path, "roles") == '{"made": 1}' and not store.parts_owed, "the first one writes them"
    store.save(job, [Event("second", "")], "127.0.0.1:1", [], lazy_parts=True)
    assert len(made) == 1 and store.parts_owed and not store.parts_due(), "left for later"
    assert [e["kind"] for e in read_status(tmp_path)["events"]][-1] == "second", "its events are written at once"
    store.save(job, [], "127.0.0.1:1", [])
    assert read_part(tmp_path, "roles") == '{"made": 2}' and not store.parts_owed


def test_a_save_of_the_nodes_rows_alone_makes_the_parts_only_when_they_are_old(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tick's refresh of the nodes' last-seen times applies no change: it does not make the parts (O(processes):
    300-600 ms at 4096 role processes), keeps what a lazy save owed, and makes them once they are
    ``PARTS_REFRESH_S`` old (a change made without an event gets there within that)."""
    import convoy.control.store as store_module
    from convoy.control.store import read_part

    made = []
    store.parts["roles"] = lambda: made.append(1) or json.dumps({"made": len(made)})
    job = Job("feedbeef", Rendezvous(1, 1, 0.0, opened_at=0.0), max_restarts=3, join_timeout_s=60.0)
    node = NodeRecord("n1", "127.0.0.1", 1, 0.0, 0.0)
    store.save(job, [Event("first", "")], "127.0.0.1:1", [node])
    assert len(made) == 1
    node.last_seen = 7.0
    store.save(job, [], "127.0.0.1:1", [node], rows_only=True)
    assert len(made) == 1 and not store.parts_owed, "fresh parts are not made again"
    assert read_status(tmp_path)["nodes"][0]["last_seen"] > read_status(tmp_path)["nodes"][0]["first_seen"], \
        "the rows are written"
    store.parts_owed = True  # a lazy save left them
    store.save(job, [], "127.0.0.1:1", [node], rows_only=True)
    assert len(made) == 1 and store.parts_owed, "what was owed stays owed (the tick writes it when due)"
    monkeypatch.setattr(store_module, "PARTS_REFRESH_S", 0.0)
    store.save(job, [], "127.0.0.1:1", [node], rows_only=True)
    assert len(made) == 2 and not store.parts_owed and read_part(tmp_path, "roles") == '{"made": 2}'


def test_a_rounds_row_is_made_once_not_at_every_save(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    job, registry = job_through_a_restart(store)
    made = []
    monkeypatch.setattr(store, "_save_round", lambda membership, now: made.append(membership.round_id))
    for _ in range(3):
        store.save(job, [], "127.0.0.1:4000", list(registry.nodes.values()))
    assert made == [], "round 2's row was written when it closed (at thousands of members it is not made again)"
