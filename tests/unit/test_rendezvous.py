"""The rendezvous state machine, driven with explicit times: no processes, no clocks."""

from __future__ import annotations

from convoy.control.rendezvous import Membership, Rendezvous


def make(min_nodes: int = 1, max_nodes: int = 2, wait_s: float = 5.0, now: float = 0.0) -> Rendezvous:
    return Rendezvous(min_nodes=min_nodes, max_nodes=max_nodes, wait_s=wait_s, opened_at=now)


def join(rdzv: Rendezvous, node_id: str, now: float, nproc: int = 2, port: int | None = None) -> int:
    host = f"10.0.0.{ord(node_id[0]) - ord('a') + 1}"
    return rdzv.join(node_id, host, nproc, port if port is not None else 20000 + ord(node_id[0]), now)


def order(membership: Membership | None) -> list[str]:
    assert membership is not None, "the round should have closed"
    return [m.node_id for m in sorted(membership.members, key=lambda m: m.node_rank)]


def test_round_closes_at_once_when_max_nodes_have_joined() -> None:
    rdzv = make(min_nodes=1, max_nodes=2, wait_s=100.0)
    assert join(rdzv, "a", now=0.0) == 1
    assert rdzv.is_open and rdzv.membership is None
    assert join(rdzv, "b", now=0.1) == 1
    assert not rdzv.is_open
    assert rdzv.membership is not None and rdzv.membership.round_id == 1
    assert order(rdzv.membership) == ["a", "b"]
    assert [m.node_rank for m in rdzv.membership.members] == [0, 1]


def test_round_at_min_closes_only_after_the_wait_window() -> None:
    rdzv = make(min_nodes=1, max_nodes=3, wait_s=5.0)
    join(rdzv, "a", now=10.0)
    assert rdzv.is_open, "one node is MIN but the window has not passed"
    assert rdzv.tick(14.9) is None and rdzv.is_open
    join(rdzv, "b", now=12.0)  # joins inside the window: part of the round
    closed = rdzv.tick(15.0)
    assert closed is not None and closed is rdzv.membership
    assert order(closed) == ["a", "b"]
    assert rdzv.tick(16.0) is None, "tick returns a membership only when the round closes"


def test_wait_window_starts_when_min_is_reached_not_at_the_first_join() -> None:
    rdzv = make(min_nodes=2, max_nodes=3, wait_s=5.0)
    join(rdzv, "a", now=0.0)
    join(rdzv, "b", now=4.0)
    assert rdzv.tick(8.9) is None
    assert order(rdzv.tick(9.0)) == ["a", "b"]


def test_round_below_min_never_closes_and_reports_since_when() -> None:
    rdzv = make(min_nodes=2, max_nodes=3, wait_s=0.0, now=7.0)
    join(rdzv, "a", now=8.0)
    assert rdzv.tick(10_000.0) is None and rdzv.is_open
    assert rdzv.short_of_min_since() == 7.0
    join(rdzv, "b", now=10_001.0)
    assert rdzv.short_of_min_since() is None


def test_zero_wait_closes_at_min_on_the_join_itself() -> None:
    rdzv = make(min_nodes=1, max_nodes=4, wait_s=0.0)
    join(rdzv, "a", now=1.0)
    assert order(rdzv.membership) == ["a"]


def test_rank_offsets_and_world_size_follow_each_nodes_nproc() -> None:
    rdzv = make(min_nodes=3, max_nodes=3)
    join(rdzv, "a", now=0.0, nproc=2)
    join(rdzv, "b", now=1.0, nproc=3)
    join(rdzv, "c", now=2.0, nproc=1)
    membership = rdzv.membership
    assert membership is not None
    assert [(m.node_id, m.node_rank, m.nproc, m.rank_offset) for m in membership.members] == [
        ("a", 0, 2, 0), ("b", 1, 3, 2), ("c", 2, 1, 5),
    ]
    assert membership.world_size == 6
    assert membership.member("b") is not None and membership.member("b").rank_offset == 2  # type: ignore[union-attr]
    assert membership.member("zz") is None
    assert membership.node_ids() == {"a", "b", "c"}


def test_master_addr_and_port_come_from_node_rank_zero() -> None:
    rdzv = make(min_nodes=2, max_nodes=2)
    rdzv.join("a", "10.1.1.1", 1, 29501, 0.0)
    rdzv.join("b", "10.2.2.2", 1, 29502, 1.0)
    membership = rdzv.membership
    assert membership is not None
    assert (membership.master_addr, membership.master_port) == ("10.1.1.1", 29501)


def test_node_ranks_are_sticky_across_rounds_whatever_the_join_order() -> None:
    rdzv = make(min_nodes=2, max_nodes=2)
    join(rdzv, "a", now=0.0)
    join(rdzv, "b", now=1.0)
    assert order(rdzv.membership) == ["a", "b"]
    assert rdzv.open_next(now=10.0) == 2
    join(rdzv, "b", now=11.0, port=30002)
    join(rdzv, "a", now=12.0, port=30001)
    membership = rdzv.membership
    assert membership is not None and membership.round_id == 2
    assert order(membership) == ["a", "b"], "a kept node rank 0 although b rejoined first"
    assert (membership.master_addr, membership.master_port) == ("10.0.0.1", 30001), "rank 0's fresh port"


def test_newcomers_are_appended_after_the_previous_members() -> None:
    rdzv = make(min_nodes=2, max_nodes=3, wait_s=1.0)
    join(rdzv, "a", now=0.0)
    join(rdzv, "b", now=0.5)
    assert order(rdzv.tick(2.0)) == ["a", "b"]
    rdzv.open_next(now=3.0)
    join(rdzv, "c", now=3.1)
    join(rdzv, "b", now=3.2)
    join(rdzv, "a", now=3.3)
    assert order(rdzv.membership) == ["a", "b", "c"]
    assert [m.rank_offset for m in rdzv.membership.members] == [0, 2, 4]  # type: ignore[union-attr]


def test_ranks_close_up_when_a_previous_member_is_missing() -> None:
    rdzv = make(min_nodes=2, max_nodes=3, wait_s=1.0)
    for i, node in enumerate("abc"):
        join(rdzv, node, now=float(i))
    rdzv.open_next(now=10.0)
    join(rdzv, "c", now=11.0)
    join(rdzv, "b", now=11.5)
    membership = rdzv.tick(20.0)
    assert order(membership) == ["b", "c"]
    assert [m.node_rank for m in membership.members] == [0, 1]  # type: ignore[union-attr]
    assert membership.master_addr == "10.0.0.2"  # type: ignore[union-attr]


def test_join_while_a_round_runs_waits_for_the_next_round() -> None:
    rdzv = make(min_nodes=2, max_nodes=3, wait_s=1.0)
    join(rdzv, "a", now=0.0)
    join(rdzv, "b", now=0.0)
    first = rdzv.tick(1.0)
    assert first is not None
    assert join(rdzv, "c", now=5.0) == 2, "c is told to wait for round 2"
    assert rdzv.membership is first and order(first) == ["a", "b"], "the running round is not disturbed"
    assert "c" not in rdzv.joined
    assert rdzv.open_next(now=6.0) == 2
    assert rdzv.joined == ["c"], "the pending node is admitted into the new round"
    join(rdzv, "a", now=6.1)
    join(rdzv, "b", now=6.2)
    assert order(rdzv.membership) == ["a", "b", "c"]


def test_pending_nodes_beyond_max_stay_pending() -> None:
    rdzv = make(min_nodes=1, max_nodes=1)
    join(rdzv, "a", now=0.0)
    assert join(rdzv, "b", now=1.0) == 2
    assert join(rdzv, "c", now=2.0) == 2
    rdzv.open_next(now=3.0)
    assert order(rdzv.membership) == ["b"], "one pending node fills the round of max 1 at once"
    assert "c" not in rdzv.joined


def test_rejoining_the_open_round_does_not_count_twice() -> None:
    rdzv = make(min_nodes=2, max_nodes=2)
    join(rdzv, "a", now=0.0)
    join(rdzv, "a", now=1.0)
    assert rdzv.is_open and rdzv.joined == ["a"]


def test_leave_forgets_a_joiner_and_restarts_the_min_window() -> None:
    rdzv = make(min_nodes=2, max_nodes=3, wait_s=5.0)
    join(rdzv, "a", now=0.0)
    join(rdzv, "b", now=1.0)
    rdzv.leave("b", now=2.0)
    assert rdzv.joined == ["a"]
    assert rdzv.tick(100.0) is None, "below MIN again: the old window no longer counts"
    join(rdzv, "b", now=200.0)
    assert rdzv.tick(204.9) is None
    assert order(rdzv.tick(205.0)) == ["a", "b"]


def test_leave_above_min_keeps_the_window() -> None:
    rdzv = make(min_nodes=1, max_nodes=3, wait_s=5.0)
    join(rdzv, "a", now=0.0)
    join(rdzv, "b", now=1.0)
    rdzv.leave("b", now=2.0)
    assert order(rdzv.tick(5.0)) == ["a"]


def test_leave_of_a_pending_node_keeps_it_out_of_the_next_round() -> None:
    rdzv = make(min_nodes=1, max_nodes=2)
    join(rdzv, "a", now=0.0)
    join(rdzv, "b", now=0.0)
    join(rdzv, "c", now=1.0)
    rdzv.leave("c", now=2.0)
    rdzv.open_next(now=3.0)
    assert rdzv.joined == []


def test_open_next_ends_the_round() -> None:
    rdzv = make(min_nodes=1, max_nodes=1)
    join(rdzv, "a", now=0.0)
    assert rdzv.open_next(now=4.0) == 2
    assert rdzv.round_id == 2 and rdzv.is_open and rdzv.membership is None
    assert rdzv.joined == [] and rdzv.opened_at == 4.0


def test_a_first_round_orders_nodes_by_the_rank_they_ask_for_then_keeps_them() -> None:
    rdzv = make(min_nodes=3, max_nodes=3)
    rdzv.join("a", "10.0.0.1", 1, 20001, 0.0, node_rank=2)
    rdzv.join("b", "10.0.0.2", 1, 20002, 1.0)  # asks for none: after those that asked
    rdzv.join("c", "10.0.0.3", 1, 20003, 2.0, node_rank=0)
    assert order(rdzv.membership) == ["c", "a", "b"]
    assert rdzv.open_next(now=10.0) == 2
    rdzv.join("b", "10.0.0.2", 1, 20002, 11.0, node_rank=0)  # a later ask does not move ranks already held
    rdzv.join("a", "10.0.0.1", 1, 20001, 12.0, node_rank=2)
    rdzv.join("c", "10.0.0.3", 1, 20003, 13.0, node_rank=0)
    assert order(rdzv.membership) == ["c", "a", "b"]
