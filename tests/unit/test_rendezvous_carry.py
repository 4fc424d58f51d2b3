"""A regroup of the same nodes places those that offered a port for the next round without a join each: the
first call of each one's agent about the new round places it, so a node whose agent died is never placed."""

from __future__ import annotations

from job_states import failure, join_all, kinds, make_job

from convoy.control.rendezvous import Rendezvous


def closed_round(nodes: list[str], max_nodes: int | None = None) -> Rendezvous:
    rdzv = Rendezvous(min_nodes=1, max_nodes=max_nodes or len(nodes), wait_s=100.0, opened_at=0.0)
    for i, node in enumerate(nodes):
        rdzv.join(node, f"10.0.0.{i + 1}", 2, 20000 + i, now=0.1 * i)
    rdzv.tick(200.0)  # below MAX: the window closes it
    assert rdzv.membership is not None and rdzv.membership.round_id == 1
    return rdzv


def test_survivors_that_offered_ports_make_the_next_round_when_their_agents_ask() -> None:
    rdzv = closed_round(["a", "b", "c"])
    for i, node in enumerate(["a", "b", "c"]):
        rdzv.offer_next(node, 1, 31000 + i)
    assert rdzv.open_next(now=5.0, expected={"b", "c"}) == 2  # a is lost
    assert rdzv.is_open and rdzv.carried == frozenset(), "nobody is placed before its agent is heard from"
    assert rdzv.confirm("c", 1, now=5.1) is None and rdzv.is_open, "a call about the old round places nothing"
    assert rdzv.confirm("c", 2, now=5.2) is None and rdzv.is_waiting("c")
    assert rdzv.confirm("a", 2, now=5.2) is None and not rdzv.is_waiting("a"), "a lost node is not expected"
    membership = rdzv.confirm("b", 2, now=5.3)
    assert membership is not None and membership is rdzv.membership and membership.round_id == 2
    assert [m.node_id for m in membership.members] == ["b", "c"], "rank order kept"
    assert (membership.master_addr, membership.master_port) == ("10.0.0.2", 31001), "rank 0's offered port"
    assert [m.rank_offset for m in membership.members] == [0, 2]
    assert rdzv.carried == {"b", "c"} and rdzv.confirm("b", 2, now=6.0) is None, "placed once"


def test_a_node_whose_agent_is_never_heard_from_again_leaves_and_the_round_closes_without_it() -> None:
    rdzv = closed_round(["a", "b"])
    rdzv.offer_next("a", 1, 31000)
    rdzv.offer_next("b", 1, 31001)
    rdzv.open_next(now=5.0, expected={"a", "b"})  # a restart: b's agent died with its workers
    assert rdzv.confirm("a", 2, now=5.1) is None and rdzv.is_open, "the round waits for b"
    rdzv.leave("b", now=10.0)  # its heartbeats stopped: lost
    assert rdzv.tick(10.0) is not None and [m.node_id for m in rdzv.membership.members] == ["a"]
    assert rdzv.confirm("b", 2, now=11.0) is None, "a node that left is placed no more"


def test_a_survivor_without_an_offer_joins_and_the_round_waits_for_it() -> None:
    rdzv = closed_round(["a", "b", "c"])
    rdzv.offer_next("a", 1, 31000)
    rdzv.offer_next("b", 1, 31001)
    rdzv.open_next(now=5.0, expected={"a", "b", "c"})
    for node in ("a", "b", "c"):
        rdzv.confirm(node, 2, now=5.1)
    assert rdzv.is_open and rdzv.carried == {"a", "b"} and not rdzv.is_waiting("c")
    rdzv.join("c", "10.0.0.3", 2, 32000, now=6.0)
    assert rdzv.membership is not None and [m.node_id for m in rdzv.membership.members] == ["a", "b", "c"]
    assert rdzv.membership.master_port == 31000


def test_offers_for_another_round_or_from_non_members_are_ignored_and_an_offer_serves_once() -> None:
    rdzv = closed_round(["a", "b"])
    rdzv.offer_next("a", 2, 31000)  # not the running round
    rdzv.offer_next("x", 1, 31001)  # not a member
    rdzv.offer_next("b", 1, 0)  # no port
    rdzv.open_next(now=5.0, expected={"a", "b"})
    for node in ("a", "b", "x"):
        assert rdzv.confirm(node, 2, now=5.1) is None
    assert rdzv.carried == frozenset() and rdzv.is_open
    rdzv.join("a", "10.0.0.1", 2, 32000, now=6.0)
    rdzv.join("b", "10.0.0.2", 2, 32001, now=6.0)
    rdzv.offer_next("a", 2, 33000)
    rdzv.offer_next("b", 2, 33001)
    rdzv.open_next(now=7.0, expected={"a", "b"})
    rdzv.confirm("b", 3, now=7.1)
    assert rdzv.confirm("a", 3, now=7.1) is not None and rdzv.membership.master_port == 33000
    rdzv.open_next(now=8.0, expected={"a", "b"})  # round 3 was made from the offers: none is left for round 4
    assert rdzv.confirm("a", 4, now=8.1) is None and rdzv.is_open and rdzv.carried == frozenset()


def test_an_open_without_expected_nodes_places_nobody() -> None:
    rdzv = closed_round(["a", "b"])
    rdzv.offer_next("a", 1, 31000)
    rdzv.open_next(now=5.0)
    assert rdzv.confirm("a", 2, now=5.1) is None and rdzv.carried == frozenset() and not rdzv.is_waiting("a")


def test_a_node_joining_for_the_next_round_is_placed_beside_the_carried_ones() -> None:
    rdzv = closed_round(["a", "b"], max_nodes=3)
    rdzv.offer_next("a", 1, 31000)
    rdzv.offer_next("b", 1, 31001)
    assert rdzv.join("c", "10.0.0.3", 1, 32002, now=1.0) == 2  # queued while round 1 runs
    rdzv.open_next(now=5.0, expected={"a", "b", "c"})
    rdzv.confirm("a", 2, now=5.1)
    rdzv.confirm("b", 2, now=5.1)
    assert rdzv.membership is not None and [m.node_id for m in rdzv.membership.members] == ["a", "b", "c"]


def test_a_restart_after_a_worker_failure_closes_its_round_with_the_last_agent_heard_and_says_so() -> None:
    job = make_job(max_restarts=3)
    join_all(job, now=0.0)
    for i, node in enumerate(["n0", "n1"]):
        job.rendezvous.offer_next(node, 1, 31000 + i)
    assert kinds(job.worker_exited(failure("n1", 1, rank=3, local_rank=1, exitcode=7), now=5.0)) == [
        "worker_failed", "restart"]
    assert job.confirm("n1", 2, now=5.1) == []
    events = job.confirm("n0", 2, now=5.2)
    assert kinds(events) == ["round_closed"] and "2 of them placed without a join" in events[0].message
    assert job.membership is not None and job.membership.round_id == 2 and job.membership.master_port == 31000


def test_a_job_of_roles_places_every_node_that_stays_on_its_last_port() -> None:
    rdzv = closed_round(["a", "b", "c"])
    rdzv.carry_all = True  # its rounds only gather the nodes: no store is served on the port
    rdzv.offer_next("c", 1, 31002)
    rdzv.open_next(now=5.0, expected={"a", "c"})
    rdzv.confirm("c", 2, now=5.1)
    membership = rdzv.confirm("a", 2, now=5.2)
    assert membership is not None and [m.node_id for m in membership.members] == ["a", "c"]
    assert membership.master_port == 20000 and rdzv.carried == {"a", "c"}
    rdzv.open_next(now=6.0, expected={"a", "c"})
    rdzv.confirm("a", 3, now=6.1)
    assert rdzv.confirm("c", 3, now=6.2) is not None, "and again from the ports of round 2"
