"""Node registry and failure detection by heartbeat silence, as pure code."""

from __future__ import annotations

from dataclasses import dataclass, field

ROWS_REFRESH_S = 5.0
"""How often every node's row is written again (their last-seen times); between, a write holds only the nodes that
changed, so a thousand joins do not each rewrite a thousand rows."""


@dataclass
class NodeRecord:
    node_id: str
    host: str
    nproc: int
    first_seen: float
    last_seen: float
    state: str = "alive"
    instance: str = ""
    """Random id of the agent process behind this node id (tells a duplicate from a restart)."""


@dataclass
class NodeRegistry:
    """Who has checked in and when; ``expired`` names the nodes silent for too long."""

    timeout_s: float
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    changed: set[str] = field(default_factory=set)
    """Nodes whose row (host, size, state, agent) changed since the state file last got them."""
    _all_written: tuple[object, float] = (None, float("-inf"))
    """(the ranks' key, when) of the last write of every row."""

    def to_write(self, ranks: object, now: float) -> tuple[list[NodeRecord], bool]:
        """The rows a state write holds: every one when the ranks moved (``ranks``: a key of the round's membership)
        or ``ROWS_REFRESH_S`` passed, else the changed ones; and whether that is every one."""
        if ranks is not self._all_written[0] or now - self._all_written[1] >= ROWS_REFRESH_S:
            return list(self.nodes.values()), True
        return [self.nodes[node_id] for node_id in self.changed if node_id in self.nodes], False

    def rows_stale(self, now: float) -> bool:
        return now - self._all_written[1] >= ROWS_REFRESH_S and bool(self.nodes)

    def written(self, ranks: object, every: bool, now: float) -> None:
        """The rows ``to_write`` gave are in the state file."""
        self.changed.clear()
        if every:
            self._all_written = (ranks, now)

    def register(self, node_id: str, host: str, nproc: int, now: float, instance: str = "",
                 busy_window_s: float = 0.0) -> NodeRecord | None:
        """Record a join; None if another agent that is still checking in holds this node id.

        An agent whose heartbeats arrived within ``busy_window_s`` counts as still there; a
        crashed agent stops at once, so its node id is free again after that window.
        """
        record = self.nodes.get(node_id)
        if record is None:
            record = self.nodes[node_id] = NodeRecord(node_id, host, nproc, now, now)
        elif (record.state == "alive" and instance and record.instance and record.instance != instance
              and now - record.last_seen < busy_window_s):
            return None
        record.host, record.nproc, record.last_seen, record.state = host, nproc, now, "alive"
        self.changed.add(node_id)
        record.instance = instance or record.instance
        return record

    def seen(self, node_id: str, now: float) -> bool:
        """Note a heartbeat; False if the node is unknown or already declared lost."""
        record = self.nodes.get(node_id)
        if record is None or record.state != "alive":
            return False
        record.last_seen = now
        return True

    def mark(self, node_id: str, state: str) -> None:
        if node_id in self.nodes:
            self.nodes[node_id].state = state
            self.changed.add(node_id)

    def expired(self, now: float) -> list[str]:
        """Alive nodes not heard from within the timeout; they are marked lost."""
        lost = [n.node_id for n in self.nodes.values() if n.state == "alive" and now - n.last_seen > self.timeout_s]
        for node_id in lost:
            self.nodes[node_id].state = "lost"
        self.changed.update(lost)
        return lost
