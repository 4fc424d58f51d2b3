"""Where a role process goes: the nodes with room for what its role declares (memory, CPUs, GPUs), its last node
first, else the one running the fewest processes; a process no node has room for waits, said once, and a role
that stays below its MIN that way fails the job. Pure: the RoleMaster says what is placed where, ``Rooms`` keeps
what each node has and answers.

A node's room is what it reported when it first joined (its free memory, its CPUs and GPUs) less what the
processes placed on it declare; a process that declares nothing fits anywhere (but GPUs are always counted: a
device is handed to one process at a time).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from convoy.control.job import Event
from convoy.control.pool.claims import Amount
from convoy.control.roles.flat import flat

GIB = 1 << 30


@dataclass(frozen=True)
class Need:
    """What one process of a role takes from its node (0: not declared)."""

    memory_bytes: int = 0
    cpus: float = 0.0
    gpus: int = 0

    def amount(self) -> Amount:
        """What it takes from the machine's pool: its CPUs and its memory."""
        return Amount(self.cpus, float(self.memory_bytes))

    def describe(self) -> str:
        parts = [f"{self.memory_bytes / GIB:.2f} GiB"] if self.memory_bytes else []
        parts += [f"{self.cpus:g} CPU(s)"] if self.cpus else []
        parts += [f"{self.gpus} GPU(s)"] if self.gpus else []
        return " and ".join(parts) or "nothing declared"


@dataclass
class Placed:
    node_id: str
    port: int = 0
    address: str = ""
    gpus: list[int] = field(default_factory=list)
    """The node's devices handed to the process."""


@dataclass
class NodeRoom:
    """A node as it joined: its memory (0: unknown, not checked), CPUs (0: unknown) and GPUs (device indices)."""

    memory_bytes: int = 0
    cpus: float = 0.0
    gpus: int = 0


@dataclass
class Taken:
    """What the processes placed on one node take."""

    memory_bytes: int = 0
    cpus: float = 0.0
    gpus: set[int] = field(default_factory=set)
    processes: int = 0

    def add(self, need: Need, gpus: Iterable[int]) -> None:
        self.memory_bytes += need.memory_bytes
        self.cpus += need.cpus
        self.gpus |= set(gpus)
        self.processes += 1


@dataclass(frozen=True)
class Choice:
    node_id: str
    gpus: tuple[int, ...]
    """The node's device indices handed to the process (CUDA_VISIBLE_DEVICES)."""


def fits(room: NodeRoom, taken: Taken, need: Need) -> bool:
    """Whether ``need`` fits beside what ``taken`` holds; a resource the node did not report is not checked,
    but a process that asks for GPUs needs a node that has them."""
    if need.memory_bytes and room.memory_bytes and taken.memory_bytes + need.memory_bytes > room.memory_bytes:
        return False
    if need.cpus and room.cpus and taken.cpus + need.cpus > room.cpus + 1e-9:
        return False
    return room.gpus - len(taken.gpus) >= need.gpus


def choose(nodes: Sequence[str], rooms: Mapping[str, NodeRoom], taken: Mapping[str, Taken], need: Need,
           home: str = "") -> Choice | None:
    """The node for one process: ``home`` when it has room, else the node with room that runs the fewest
    processes (the earlier in ``nodes`` on a tie); None when no node has room."""
    with_room = [node for node in nodes if fits(rooms.get(node, NodeRoom()), taken.get(node, Taken()), need)]
    if not with_room:
        return None
    node = home if home in with_room else min(with_room, key=lambda n: taken.get(n, Taken()).processes)
    used = taken.get(node, Taken()).gpus
    free = [index for index in range(rooms.get(node, NodeRoom()).gpus) if index not in used]
    return Choice(node, tuple(free[: need.gpus]))


class LeastLoaded:
    """``choose`` for the processes of one placing pass that declare nothing (every node fits them): the node
    running the fewest, from a heap instead of a look at every node (at thousands of nodes a pass placing one
    process a node was quadratic). ``taken`` is the pass's, which ``Rooms.place`` grows."""

    def __init__(self, nodes: Sequence[str], taken: Mapping[str, Taken]) -> None:
        self.taken = taken
        self.heap = [(taken[node].processes if node in taken else 0, index, node) for index, node in enumerate(nodes)]
        heapq.heapify(self.heap)
        self.nodes = set(nodes)

    def choose(self, home: str = "") -> Choice | None:
        if home in self.nodes:
            return Choice(home, ())
        while self.heap:
            count, index, node = self.heap[0]
            now = self.taken[node].processes if node in self.taken else 0
            if now == count:  # (an entry of a node placed on since it was pushed is pushed again with its count)
                heapq.heapreplace(self.heap, (count + 1, index, node))
                return Choice(node, ())
            heapq.heapreplace(self.heap, (now, index, node))
        return None


def describe_room(nodes: Sequence[str], rooms: Mapping[str, NodeRoom], taken: Mapping[str, Taken]) -> str:
    """What each node has left, for a line that says why a process waits."""
    parts = []
    for node in nodes:
        room, used = rooms.get(node, NodeRoom()), taken.get(node, Taken())
        left = []
        if room.memory_bytes:
            left.append(f"{max(0, room.memory_bytes - used.memory_bytes) / GIB:.2f} GiB")
        if room.cpus:
            left.append(f"{max(0.0, room.cpus - used.cpus):g} CPU(s)")
        left.append(f"{room.gpus - len(used.gpus)} GPU(s)")
        parts.append(f"{node} {', '.join(left)}")
    return "; ".join(parts)


Key = tuple[str, int, int]


class Rooms:
    """The room each node reported at its first join, the processes whose wait for room was said (once each), and
    since when each role has had fewer processes placed than its MIN for want of room."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeRoom] = {}
        self.told_waiting: set[Key] = set()
        self.short: dict[str, float] = {}

    def node_joined(self, node_id: str, memory_bytes: int, cpus: float, gpus: int) -> None:
        """A node's first join sets its room; a later one (a regroup, with processes running and less memory
        free) does not."""
        self.nodes.setdefault(node_id, NodeRoom(memory_bytes, float(cpus), gpus))

    def place(self, key: Key, need: Need, nodes: Sequence[str], taken: dict[str, Taken], home: str,
              running: int, world_size: int, minimum: int, least: LeastLoaded | None = None
              ) -> tuple[Choice | None, list[Event]]:
        """The node for process ``key`` (and ``taken`` counts it there), or None and, the first time, the line
        that says why it waits: ``running`` of the role's ``world_size`` processes are placed, its MIN
        ``minimum``. ``least``: the pass's heap, for a process that declares nothing."""
        if least is not None and need == Need():
            choice = least.choose(home)
        else:
            choice = choose(nodes, self.nodes, taken, need, home)
        if choice is not None:
            taken.setdefault(choice.node_id, Taken()).add(need, choice.gpus)
            return choice, []
        if key in self.told_waiting:
            return None, []
        self.told_waiting.add(key)
        return None, [Event("role_waits", f"{key[0]} {key[1]} waits for room: it needs {need.describe()}, and the "
                            f"nodes have {describe_room(nodes, self.nodes, taken)}; role {key[0]} runs {running} of "
                            f"its {world_size} process(es) meanwhile (MIN {minimum})", console=True)]

    def below_min_too_long(self, role: str, short: bool, now: float, limit_s: float) -> float | None:
        """How long ``role`` has been ``short`` (below its MIN with a process waiting for room), once that is
        over ``limit_s``; None while it is not."""
        if not short:
            self.short.pop(role, None)
            return None
        waited = now - self.short.setdefault(role, now)
        return waited if waited > limit_s else None

    def state(self) -> dict[str, Any]:
        return {"nodes": {node: flat(room) for node, room in self.nodes.items()},
                "told_waiting": [list(key) for key in sorted(self.told_waiting)], "short": self.short}

    def load_state(self, saved: dict[str, Any]) -> None:
        self.nodes = {node: NodeRoom(**room) for node, room in saved["nodes"].items()}
        self.told_waiting = {(role, rank, incarnation) for role, rank, incarnation in saved["told_waiting"]}
        self.short = dict(saved["short"])  # monotonic times: a master restarted on the same host reads them right


def room_for_all(needs: Sequence[Need], nodes: Sequence[str], rooms: Mapping[str, NodeRoom],
                 taken: Mapping[str, Taken]) -> bool:
    """Whether every one of ``needs`` has a node at once, beside what ``taken`` holds (a group's members start
    together: one placed without the others would wait in its rendezvous for them)."""
    trial = {node: Taken(used.memory_bytes, used.cpus, set(used.gpus), used.processes) for node, used in taken.items()}
    for need in needs:
        choice = choose(nodes, rooms, trial, need)
        if choice is None:
            return False
        trial.setdefault(choice.node_id, Taken()).add(need, choice.gpus)
    return True
