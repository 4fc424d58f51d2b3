"""Which Ray nodes can hold one of the job's agents, and what is missing where none can (pure: no Ray).

An agent holds its node's share of the job (``NodeShare``: CPUs, GPUs, memory, custom resources), asked of Ray as
the resources of the actor that starts it; the share is placed on a node only if the node's total has room for it,
one agent per node, up to the job's MAX nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

NODE_PREFIX = "ray-"


@dataclass(frozen=True)
class NodeShare:
    """What one agent holds on its Ray node."""

    cpus: float = 1.0
    gpus: float = 0.0
    memory_bytes: int = 0
    resources: Mapping[str, float] = field(default_factory=dict)
    """Custom resources (``--ray-resource NAME=AMOUNT``), e.g. one a node type declares."""

    def request(self) -> dict[str, float]:
        """The share as Ray names its resources (only what is asked)."""
        asked = {"CPU": self.cpus, "GPU": self.gpus, "memory": float(self.memory_bytes), **self.resources}
        return {name: amount for name, amount in asked.items() if amount > 0}


@dataclass(frozen=True)
class RayNode:
    """A node as ``ray.nodes()`` lists it."""

    node_id: str
    address: str
    alive: bool
    total: Mapping[str, float]

    @property
    def name(self) -> str:
        return node_name(self.node_id)


def node_name(node_id: str) -> str:
    """The convoy node id of the agent on a Ray node: the first 12 hex digits of its Ray node id."""
    return NODE_PREFIX + node_id[:12]


def from_listing(listing: Iterable[Mapping]) -> list[RayNode]:
    """``ray.nodes()`` as ``RayNode``s."""
    return [RayNode(str(entry.get("NodeID", "")), str(entry.get("NodeManagerAddress", "")),
                    bool(entry.get("Alive", False)), dict(entry.get("Resources") or {})) for entry in listing]


def fits(node: RayNode, share: NodeShare) -> bool:
    return node.alive and all(node.total.get(name, 0.0) >= amount for name, amount in share.request().items())


def to_place(nodes: Iterable[RayNode], share: NodeShare, holding: Iterable[str], max_nodes: int,
             skip: Iterable[str] = ()) -> list[RayNode]:
    """The nodes to start agents on now: alive, with room for the share, not holding one already (by convoy node
    name) nor skipped (a node whose placement just failed), until the job has MAX."""
    taken = set(holding) | set(skip)
    free = max(0, max_nodes - len(set(holding)))
    return [node for node in sorted(nodes, key=lambda node: node.node_id)
            if node.name not in taken and fits(node, share)][:free]


def missing(nodes: Iterable[RayNode], share: NodeShare, min_nodes: int) -> str:
    """What keeps MIN nodes from being placed, one clause per resource: how many nodes have room for it."""
    alive = [node for node in nodes if node.alive]
    clauses = []
    for name, amount in share.request().items():
        have = sum(1 for node in alive if node.total.get(name, 0.0) >= amount)
        if have < min_nodes:
            most = max((node.total.get(name, 0.0) for node in alive), default=0.0)
            where = "no node has any" if most == 0 else \
                f"{have} node(s) have that much (the most on one: {_amount(name, most)})"
            clauses.append(f"{name} {_amount(name, amount)} per node: {where}")
    fitting = sum(1 for node in alive if fits(node, share))
    if not clauses:  # each resource alone is there on enough nodes, but not all of them together
        clauses.append(f"only {fitting} node(s) have all of {_describe(share)}")
    return f"{fitting} of the {min_nodes} node(s) MIN asks for can be placed on the Ray cluster " \
           f"({len(alive)} alive node(s)); missing: " + "; ".join(clauses)


def _describe(share: NodeShare) -> str:
    return ", ".join(f"{name} {_amount(name, amount)}" for name, amount in share.request().items())


def _amount(name: str, amount: float) -> str:
    return f"{amount / 2**30:.1f} GiB" if name == "memory" else f"{amount:g}"
