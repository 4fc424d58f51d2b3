"""Priorities among the convoy jobs of one Ray cluster (pure: no Ray): each job's claim of nodes, where its agents
are, and which job gives nodes back to one of higher priority that cannot place the nodes it wants.

The claims live on the cluster, in a named detached actor every job's driver reads and writes
(``ray_agent.ClaimsBoard``). A job wants a node when it holds fewer than MAX and no node has room for one more of
its agents; jobs of lower priority give nodes back for it (the lowest priority first, the newest first among
equals), never below their MIN. Each job computes the same answer from the same claims, so the nodes given back
are exactly the ones wanted, not one per job below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from convoy.launch.schedulers.ray_nodes import NodeShare, RayNode

STALE_S = 10.0
"""A claim not renewed for this long is dropped by the board: its driver is gone."""


@dataclass(frozen=True)
class NodeClaim:
    job_id: str
    priority: int
    since: float
    """When the job started (wall clock): the newer job gives back first among equals."""
    min_nodes: int
    share: Mapping[str, float]
    """What each of its agents holds (Ray's names)."""
    nodes: tuple[str, ...] = ()
    """The Ray node ids its agents hold."""
    wanting: int = 0
    """Nodes it would place now, up to MAX, that no node has room for."""
    fits: tuple[str, ...] = ()
    """While it wants nodes: the Ray node ids whose totals would hold one of its agents (where a node given back
    helps it)."""
    renewed: float = field(default=0.0, compare=False)

    def as_dict(self) -> dict:
        return {"job_id": self.job_id, "priority": self.priority, "since": self.since, "min_nodes": self.min_nodes,
                "share": dict(self.share), "nodes": list(self.nodes), "wanting": self.wanting,
                "fits": list(self.fits)}

    @classmethod
    def from_dict(cls, entry: Mapping) -> NodeClaim:
        return cls(str(entry["job_id"]), int(entry["priority"]), float(entry["since"]), int(entry["min_nodes"]),
                   dict(entry["share"]), tuple(entry["nodes"]), int(entry["wanting"]), tuple(entry.get("fits", ())),
                   float(entry.get("renewed", 0)))


def room_left(node: RayNode, claims: Iterable[NodeClaim], job_id: str) -> dict[str, float]:
    """A node's total less the shares other jobs' agents hold on it."""
    left = dict(node.total)
    for claim in claims:
        if claim.job_id != job_id and node.node_id in claim.nodes:
            for name, amount in claim.share.items():
                left[name] = left.get(name, 0.0) - amount
    return left


def free_for(node: RayNode, share: NodeShare, claims: Iterable[NodeClaim], job_id: str) -> bool:
    left = room_left(node, claims, job_id)
    return node.alive and all(left.get(name, 0.0) >= amount for name, amount in share.request().items())


def to_give(claims: Iterable[NodeClaim], job_id: str) -> int:
    """How many nodes ``job_id`` gives back now: the nodes jobs of higher priority want, asked of the jobs below
    them from the lowest priority up (newest first), each down to its MIN."""
    claims = list(claims)
    wanted = sorted((claim for claim in claims if claim.wanting > 0), key=lambda claim: -claim.priority)
    spare = {claim.job_id: max(0, len(claim.nodes) - claim.min_nodes) for claim in claims}
    mine = 0
    for wanting in wanted:
        need = wanting.wanting
        givers = sorted((claim for claim in claims if claim.priority < wanting.priority),
                        key=lambda claim: (claim.priority, -claim.since))
        for giver in givers:
            useful = sum(1 for node in giver.nodes if node in wanting.fits)
            given = min(need, spare[giver.job_id], useful)
            spare[giver.job_id] -= given
            need -= given
            if giver.job_id == job_id:
                mine += given
            if need == 0:
                break
    return mine


def live(claims: Iterable[NodeClaim], now: float) -> list[NodeClaim]:
    """The claims renewed within ``STALE_S`` of ``now``."""
    return [claim for claim in claims if now - claim.renewed <= STALE_S]
