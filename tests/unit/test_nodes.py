"""Node registry: heartbeat silence turns into 'lost', once, with explicit times."""

from __future__ import annotations

from convoy.control.nodes import NodeRegistry


def test_silent_node_expires_once_after_the_timeout() -> None:
    registry = NodeRegistry(timeout_s=10.0)
    registry.register("a", "10.0.0.1", 2, now=0.0)
    registry.register("b", "10.0.0.2", 2, now=5.0)
    assert registry.expired(10.0) == [], "exactly at the timeout is not yet silent for too long"
    assert registry.expired(10.5) == ["a"]
    assert registry.nodes["a"].state == "lost" and registry.nodes["b"].state == "alive"
    assert registry.expired(11.0) == [], "a lost node is reported once"
    assert registry.expired(15.5) == ["b"]


def test_heartbeats_keep_a_node_alive() -> None:
    registry = NodeRegistry(timeout_s=10.0)
    registry.register("a", "10.0.0.1", 2, now=0.0)
    for now in (8.0, 16.0, 24.0):
        assert registry.seen("a", now)
        assert registry.expired(now + 9.0) == []
    assert registry.nodes["a"].last_seen == 24.0
    assert registry.expired(34.5) == ["a"]


def test_heartbeat_of_unknown_or_lost_node_is_refused_until_it_registers_again() -> None:
    registry = NodeRegistry(timeout_s=1.0)
    assert not registry.seen("ghost", 0.0)
    registry.register("a", "10.0.0.1", 1, now=0.0)
    registry.expired(5.0)
    assert not registry.seen("a", 6.0), "a heartbeat does not revive a lost node"
    assert registry.nodes["a"].state == "lost"
    record = registry.register("a", "10.0.0.9", 4, now=7.0)
    assert (record.state, record.host, record.nproc, record.last_seen) == ("alive", "10.0.0.9", 4, 7.0)
    assert record.first_seen == 0.0, "first_seen survives a re-registration"


def test_nodes_marked_left_never_expire() -> None:
    registry = NodeRegistry(timeout_s=1.0)
    registry.register("a", "10.0.0.1", 1, now=0.0)
    registry.mark("a", "left")
    registry.mark("unknown", "left")  # ignored, no error
    assert registry.expired(100.0) == []
    assert registry.nodes["a"].state == "left" and "unknown" not in registry.nodes


def test_a_state_write_holds_the_changed_rows_and_every_row_when_the_ranks_move_or_the_rows_are_old() -> None:
    from convoy.control.nodes import ROWS_REFRESH_S

    registry = NodeRegistry(timeout_s=10.0)
    for index in range(100):
        registry.register(f"n{index}", "h", 1, now=0.0)
    ranks = object()
    rows, every = registry.to_write(ranks, 0.0)
    assert every and len(rows) == 100
    registry.written(ranks, every, 0.0)
    registry.register("n100", "h", 1, now=1.0)  # a join
    registry.seen("n5", 1.0)  # a heartbeat changes no row the file needs now
    registry.mark("n7", "left")
    rows, every = registry.to_write(ranks, 1.0)
    assert not every and sorted(r.node_id for r in rows) == ["n100", "n7"]
    registry.written(ranks, every, 1.0)
    assert registry.to_write(ranks, 1.5) == ([], False) and not registry.rows_stale(1.5)
    assert len(registry.to_write(object(), 1.5)[0]) == 101  # a new round: every node's rank
    assert registry.rows_stale(ROWS_REFRESH_S) and len(registry.to_write(ranks, ROWS_REFRESH_S)[0]) == 101
    assert registry.expired(20.0) and registry.changed  # the lost are written with the next state
