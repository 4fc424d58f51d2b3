"""What each node's agent is to be told of its role processes (assignments to start, stops), delivered in its
heartbeat replies and delivered again every REDELIVER_S until the agent reports on that process: a lost reply
costs a delay, never an order. Kept per node; a restarted master tells again at once what it had not heard back
about. Beside them, every role's current addresses and incarnations, versioned, for every node.

An order that comes due again makes its node's parked heartbeat answer (``come_due``, on the master's tick): at
N nodes a heartbeat polls N/250 s, and a lost reply that carried an order would otherwise wait for the node's next
poll (16 s at 4096 nodes, which made a tenth of the processes of a job start that much later)."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from convoy.control.protocol import messages as p

REDELIVER_S = 2.0
"""An assignment or stop the agent has not reported on is sent again in its heartbeat after this long."""
NEVER = -math.inf
Key = tuple[str, int, int]
"""(role, rank, incarnation): one process."""


@dataclass
class Outbox:
    """What a node is to be told, with when it was last sent (NEVER: not yet)."""

    assignments: dict[Key, tuple[p.RoleAssignment, float]] = field(default_factory=dict)
    stops: dict[Key, tuple[p.RoleStop, float]] = field(default_factory=dict)


class Orders:
    """Every node's outbox, and the addresses all nodes are given."""

    def __init__(self) -> None:
        self.outboxes: dict[str, Outbox] = {}
        self.news = 0
        """Grows with every order queued (a parked heartbeat looks again only when it grew)."""
        self.addresses: tuple[int, dict[str, list[str]], dict[str, list[int]]] = (0, {}, {})
        self._due: list[tuple[float, str]] = []
        """(when orders sent to a node come due again, the node), soonest first."""

    def publish(self, addresses: dict[str, list[str]], incarnations: dict[str, list[int]]
                ) -> tuple[int, dict[str, list[str]], dict[str, list[int]]]:
        """``(version, addresses, incarnations)``, the version grown by one whenever either changed."""
        if (addresses, incarnations) != self.addresses[1:]:
            self.addresses = (self.addresses[0] + 1, addresses, incarnations)
        return self.addresses

    def outrank(self, held: int) -> bool:
        """A node holds version ``held``, not below this master's (one before it published it after its last save):
        the next version goes above it, with every address in it. True where the version was raised."""
        if held < self.addresses[0]:
            return False
        self.addresses = (held, {}, {})  # no addresses: the next publish differs, whatever the roles hold
        return True

    def assign(self, node_id: str, assignment: p.RoleAssignment) -> None:
        key = (assignment.role, assignment.rank, assignment.incarnation)
        self.outboxes.setdefault(node_id, Outbox()).assignments[key] = (assignment, NEVER)
        self.news += 1

    def stop(self, node_id: str, stop: p.RoleStop) -> None:
        """Stop the process: an assignment of it not yet reported on is not sent again."""
        outbox = self.outboxes.setdefault(node_id, Outbox())
        key = (stop.role, stop.rank, stop.incarnation)
        outbox.assignments.pop(key, None)
        outbox.stops[key] = (stop, NEVER)
        self.news += 1

    def reported(self, node_id: str, key: Key, exited: bool) -> None:
        """The agent reported on the process: its assignment is done with, and its stop too once it exited."""
        outbox = self.outboxes.setdefault(node_id, Outbox())
        outbox.assignments.pop(key, None)
        if exited:
            outbox.stops.pop(key, None)

    def forget(self, node_id: str) -> None:
        """The node is lost: nothing more is sent to it."""
        self.outboxes.pop(node_id, None)

    def has_news(self, node_id: str) -> bool:
        """Whether the node has assignments or stops not sent yet (its heartbeat answers at once)."""
        outbox = self.outboxes.get(node_id)
        return outbox is not None and any(sent == NEVER for _, sent in [*outbox.assignments.values(),
                                                                          *outbox.stops.values()])

    def deliver(self, node_id: str, now: float) -> tuple[list[p.RoleAssignment], list[p.RoleStop]]:
        """What to tell the node now: what it was not told yet, or was told over REDELIVER_S ago."""
        outbox = self.outboxes.get(node_id)
        if outbox is None:
            return [], []
        assignments, stops = [], []
        for key, (assignment, sent) in list(outbox.assignments.items()):
            if now - sent >= REDELIVER_S:
                assignments.append(assignment)
                outbox.assignments[key] = (assignment, now)
        for key, (stop, sent) in list(outbox.stops.items()):
            if now - sent >= REDELIVER_S:
                stops.append(stop)
                outbox.stops[key] = (stop, now)
        if assignments or stops:
            heapq.heappush(self._due, (now + REDELIVER_S, node_id))
        return assignments, stops

    def come_due(self, now: float) -> bool:
        """Orders sent ``REDELIVER_S`` ago and not reported on become unsent again, so that their node's parked
        heartbeat answers with them; True where any did (``news`` grew)."""
        found = False
        while self._due and self._due[0][0] <= now:
            _, node_id = heapq.heappop(self._due)
            outbox = self.outboxes.get(node_id)
            for box in (outbox.assignments, outbox.stops) if outbox is not None else ():
                for key, (order, sent) in box.items():  # (values replaced, no key added or removed)
                    if sent != NEVER and now - sent >= REDELIVER_S:
                        box[key] = (order, NEVER)
                        found = True
        if found:
            self.news += 1
        return found

    def state(self) -> dict[str, Any]:
        return {"published": list(self.addresses), "outboxes": {
            node: {"assignments": [a.model_dump(mode="json") for a, _ in box.assignments.values()],
                   "stops": [stop.model_dump(mode="json") for stop, _ in box.stops.values()]}
            for node, box in self.outboxes.items()}}

    def load_state(self, saved: dict[str, Any]) -> None:
        """Take back a previous master's outboxes, each order to be sent at once, and its addresses' version
        (agents hold it: a later change must go above it)."""
        version, addresses, incarnations = saved["published"]
        self.addresses = (version, addresses, incarnations)
        for node, box in saved["outboxes"].items():
            for assignment in map(p.RoleAssignment.model_validate, box["assignments"]):
                self.assign(node, assignment)
            for stop in map(p.RoleStop.model_validate, box["stops"]):
                outbox = self.outboxes.setdefault(node, Outbox())
                outbox.stops[(stop.role, stop.rank, stop.incarnation)] = (stop, NEVER)
