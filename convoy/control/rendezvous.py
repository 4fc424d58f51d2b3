"""Rendezvous as a pure state machine: rounds, rank assignment, frozen membership lists."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Member:
    node_rank: int
    node_id: str
    host: str
    nproc: int
    rank_offset: int


@dataclass(frozen=True)
class Membership:
    """What every node of a closed round is told: the same list, the same store address."""

    round_id: int
    members: tuple[Member, ...]
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    def member(self, node_id: str) -> Member | None:
        return self._by_node.get(node_id)

    @functools.cached_property
    def _by_node(self) -> dict[str, Member]:
        """Members by node id, made once (each of N nodes asks for itself)."""
        return {m.node_id: m for m in self.members}

    def node_ids(self) -> set[str]:
        return {m.node_id for m in self.members}


@dataclass
class _Joiner:
    node_id: str
    host: str
    nproc: int
    port: int
    joined_at: float
    node_rank: int = -1
    """The rank the node asked for (torchrun's --node-rank); -1: none. It orders a first membership."""


@dataclass
class Rendezvous:
    """Collects joins into rounds; a round closes at MAX nodes, or at MIN once ``wait_s`` passed.

    Nodes that join while a round runs wait for the next one. Node ranks are sticky: a node
    keeps its rank order across rounds, newcomers are appended by the rank they asked for, then in join order.
    """

    min_nodes: int
    max_nodes: int
    wait_s: float
    opened_at: float
    round_id: int = 1
    membership: Membership | None = None
    _joiners: dict[str, _Joiner] = field(default_factory=dict)
    _pending: dict[str, _Joiner] = field(default_factory=dict)
    _min_reached_at: float | None = None
    _previous_ranks: dict[str, int] = field(default_factory=dict)
    expected: frozenset[str] = frozenset()
    """Nodes a reopened round waits for: it closes once all have joined (the window does not apply)."""
    dropped: int = 0
    """How many nodes were forgotten before a round placed them (what a waiting node's poll looks at again)."""
    carried: frozenset[str] = frozenset()
    """Nodes the open (or last opened) round placed without a join (``confirm``)."""
    _placeable: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    """Expected nodes of the open round that offered a port for it (``offer_next``; in a job of roles,
    ``carry_all``: their last one): (host, nproc, port), placed once their agent is heard from."""
    _next_ports: dict[str, int] = field(default_factory=dict)
    """The port each member of the running round offered for the round after it (held by its agent)."""
    carry_all: bool = False
    """A job of roles: its rounds only gather the nodes (no store is served on a port), so a regroup places every
    expected member at once, on the port it last joined with."""
    _ports: dict[str, int] = field(default_factory=dict)
    """Each member's port in the last round that closed."""

    @property
    def is_open(self) -> bool:
        return self.membership is None

    @property
    def joined(self) -> list[str]:
        return list(self._joiners)

    def is_waiting(self, node_id: str) -> bool:
        """Whether a node has joined the open round or queued for the next one."""
        return node_id in self._joiners or node_id in self._pending

    def join(self, node_id: str, host: str, nproc: int, port: int, now: float, node_rank: int = -1) -> int:
        """Record a join; return the round the node waits for."""
        joiner = _Joiner(node_id, host, nproc, port, now, node_rank)
        if not self.is_open or (node_id not in self._joiners and len(self._joiners) >= self.max_nodes):
            self._pending[node_id] = joiner
            return self.round_id + 1
        self._joiners[node_id] = joiner
        if self._min_reached_at is None and len(self._joiners) >= self.min_nodes:
            self._min_reached_at = now
        self.tick(now)
        return self.round_id

    def leave(self, node_id: str, now: float) -> None:
        """Forget a node that has not been given a place in a running round."""
        self.dropped += 1
        self._pending.pop(node_id, None)
        self._placeable.pop(node_id, None)
        self.expected = self.expected - {node_id}
        if self._joiners.pop(node_id, None) is not None and len(self._joiners) < self.min_nodes:
            self._min_reached_at = None

    def tick(self, now: float) -> Membership | None:
        """Close the open round if its conditions hold; return the membership if it closed now."""
        if not self.is_open or not self._joiners:
            return None
        full = len(self._joiners) >= self.max_nodes
        if self.expected:  # a regroup: wait for exactly the nodes that are coming back, no window
            # (the sizes first: each of a thousand joins would otherwise compare the whole set)
            ready = len(self._joiners) >= max(self.min_nodes, len(self.expected)) \
                and self.expected <= self._joiners.keys()
        else:
            ready = self._min_reached_at is not None and now - self._min_reached_at >= self.wait_s
        if full or ready:
            return self._close()
        return None

    def short_of_min_since(self) -> float | None:
        """When the open round started waiting without MIN nodes (None if closed or at MIN)."""
        if not self.is_open or len(self._joiners) >= self.min_nodes:
            return None
        return self.opened_at

    def offer_next(self, node_id: str, round_id: int, port: int) -> None:
        """A member of the running round ``round_id`` holds ``port`` for the round after it: if the same nodes
        regroup, it is placed in that round at once on this port, without joining again (at thousands of nodes a
        join each is the larger part of a regroup). An offer for another round is ignored."""
        membership = self.membership
        if port > 0 and membership is not None and round_id == self.round_id and membership.member(node_id):
            self._next_ports[node_id] = port

    def set_previous(self, membership: Membership) -> None:
        """Remember a membership's rank order (for a master that restarts from its state)."""
        self._previous_ranks = {m.node_id: m.node_rank for m in membership.members}

    def open_next(self, now: float, expected: set[str] | frozenset[str] = frozenset()) -> int:
        """End the current round; nodes must join again. Returns the new round id.

        ``expected``: the nodes that will come back (e.g. the survivors of a node loss); the
        round closes as soon as they all have, instead of waiting out ``wait_s``. Those of them that offered a
        port for this round (``offer_next``) need no join: the first call their agent makes about this round
        places them (``confirm``), so a node whose agent died with the round is not placed.
        """
        ended, offered = self.membership, self._next_ports
        if ended is not None:
            self.set_previous(ended)
        self.expected = frozenset(expected)
        self.round_id += 1
        self.membership = None
        self.opened_at = now
        self._joiners, self._next_ports = {}, {}
        self._min_reached_at = None
        self._admit_pending(now)
        self.carried, self._placeable = frozenset(), {}
        for member in ended.members if ended is not None else ():
            port = offered.get(member.node_id) or (self._ports.get(member.node_id, 0) if self.carry_all else 0)
            if port and member.node_id in self.expected and member.node_id not in self._joiners:
                self._placeable[member.node_id] = (member.host, member.nproc, port)
        return self.round_id

    def confirm(self, node_id: str, round_id: int, now: float) -> Membership | None:
        """The agent of ``node_id`` asked about round ``round_id`` (its heartbeat or its wait, told of the round):
        where the node offered a port for this open round, it is placed now, without a join. Returns the
        membership if the round closed now."""
        placeable = self._placeable.pop(node_id, None) if round_id == self.round_id else None
        if placeable is None or not self.is_open or node_id in self._joiners:
            return None
        self.carried = self.carried | {node_id}
        self.join(node_id, *placeable, now)
        return self.membership

    def _admit_pending(self, now: float) -> None:
        """Move nodes that joined early for the new round into it."""
        for node_id, joiner in list(self._pending.items()):
            if len(self._joiners) >= self.max_nodes:
                break
            del self._pending[node_id]
            self.join(node_id, joiner.host, joiner.nproc, joiner.port, now, joiner.node_rank)

    def _close(self) -> Membership:
        order = sorted(
            self._joiners.values(),
            key=lambda j: (self._previous_ranks.get(j.node_id, len(self._previous_ranks)),
                           j.node_rank if j.node_rank >= 0 else self.max_nodes, j.joined_at),
        )
        members, offset = [], 0
        self._ports = {joiner.node_id: joiner.port for joiner in order}
        for node_rank, joiner in enumerate(order):
            members.append(Member(node_rank, joiner.node_id, joiner.host, joiner.nproc, offset))
            offset += joiner.nproc
        self.membership = Membership(self.round_id, tuple(members), order[0].host, order[0].port)
        return self.membership
