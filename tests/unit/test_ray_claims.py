"""Priorities among convoy jobs on one Ray cluster: who gives nodes back, and where a node has room (pure)."""

from __future__ import annotations

from convoy.launch.schedulers.ray_claims import NodeClaim, free_for, live, room_left, to_give
from convoy.launch.schedulers.ray_nodes import NodeShare, RayNode

SHARE = {"CPU": 1.0}


def claim(job: str, priority: int, nodes: int, min_nodes: int = 1, wanting: int = 0, since: float = 0.0,
          fits: tuple[str, ...] = ("n0", "n1", "n2", "n3", "n4", "n5")) -> NodeClaim:
    held = tuple(f"n{index}" for index in range(nodes)) if job == "low" else \
        tuple(f"n{index + 3}" for index in range(nodes))
    return NodeClaim(job, priority, since, min_nodes, SHARE, held, wanting, fits if wanting else ())


def test_a_wanting_job_of_higher_priority_is_given_nodes_down_to_each_lower_jobs_min() -> None:
    claims = [claim("low", 0, nodes=3, min_nodes=1), claim("high", 10, nodes=0, wanting=1)]
    assert to_give(claims, "low") == 1 and to_give(claims, "high") == 0
    claims[1] = claim("high", 10, nodes=0, wanting=5)
    assert to_give(claims, "low") == 2  # never below its MIN
    assert to_give([claim("low", 0, 3), claim("high", 0, 0, wanting=1)], "low") == 0  # equal priority: no one gives
    assert to_give([claim("low", 5, 3), claim("high", 1, 0, wanting=1)], "low") == 0  # lower priority wants: no


def test_the_lowest_priority_gives_first_then_the_newest_and_only_what_helps() -> None:
    oldest = NodeClaim("old", 0, 1.0, 1, SHARE, ("a1", "a2"))
    newest = NodeClaim("new", 0, 2.0, 1, SHARE, ("b1", "b2"))
    middle = NodeClaim("mid", 5, 0.0, 1, SHARE, ("c1", "c2"))
    wants = NodeClaim("top", 10, 3.0, 1, SHARE, (), 2, ("a1", "a2", "b1", "b2", "c1", "c2"))
    claims = [oldest, newest, middle, wants]
    assert [to_give(claims, job) for job in ("new", "old", "mid", "top")] == [1, 1, 0, 0]
    picky = NodeClaim("top", 10, 3.0, 1, SHARE, (), 2, ("c2",))  # only the middle job's node c2 holds it
    assert [to_give([oldest, newest, middle, picky], job) for job in ("new", "old", "mid")] == [0, 0, 1]


def test_room_on_a_node_is_its_total_less_other_jobs_agents() -> None:
    node = RayNode("n0", "127.0.0.1", True, {"CPU": 2.0, "GPU": 1.0})
    others = [NodeClaim("a", 0, 0.0, 1, {"CPU": 1.0, "GPU": 1.0}, ("n0",)),
              NodeClaim("me", 0, 0.0, 1, {"CPU": 1.0}, ("n0",))]
    assert room_left(node, others, "me") == {"CPU": 1.0, "GPU": 0.0}
    assert free_for(node, NodeShare(cpus=1), others, "me")
    assert not free_for(node, NodeShare(cpus=1, gpus=1), others, "me")


def test_claims_travel_as_dicts_and_go_stale() -> None:
    original = NodeClaim("a", 3, 1.5, 2, {"CPU": 1.0}, ("n1",), 1, ("n1", "n2"), renewed=100.0)
    assert NodeClaim.from_dict({**original.as_dict(), "renewed": 100.0}) == original
    assert live([original], now=105.0) == [original] and live([original], now=111.0) == []
