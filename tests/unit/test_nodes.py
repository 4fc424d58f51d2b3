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
