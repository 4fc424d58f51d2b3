"""What a ``RoleMaster`` writes to the job's state (JSON-ready) and how a restarted master takes it back: the
processes run on (their agents reattach and report), and what the previous master had not heard back about is told
again at once."""

from __future__ import annotations

from typing import Any, Protocol

from convoy.control.job import Event
from convoy.control.roles.flat import flat
from convoy.control.roles.members import Roles, Start
from convoy.control.roles.orders import Key, Orders
from convoy.control.roles.placement import Placed, Rooms
from convoy.control.roles.sizing import RoleSizing


class RoleMaster(Protocol):
    """What of ``control/roles/master.py``'s RoleMaster is saved (named here: the master imports this module)."""

    roles: Roles
    sizing: RoleSizing
    begun: bool
    pending: list[Start]
    placed: dict[Key, Placed]
    homes: dict[tuple[str, int], tuple[str, int]]
    stopping: set[Key]
    lost: dict[str, int]
    orders: Orders
    rooms: Rooms
    faults: list[tuple[str, str]]

    def is_current(self, key: Key) -> bool: ...


def state(master: RoleMaster) -> dict[str, Any]:
    return {
        "roles": master.roles.state(), "sizing": master.sizing.state(), "begun": master.begun,
        "pending": [flat(start) for start in master.pending],
        "placed": [[*key, flat(placed)] for key, placed in master.placed.items()],
        "homes": [[*key, *home] for key, home in master.homes.items()],
        "stopping": [list(key) for key in master.stopping], "lost": master.lost, "orders": master.orders.state(),
        "rooms": master.rooms.state(), "faults": [list(fault) for fault in master.faults],
    }


def load_state(master: RoleMaster, saved: dict[str, Any]) -> list[Event]:
    master.roles.load_state(saved["roles"])
    master.sizing.load_state(saved["sizing"])
    master.begun = saved["begun"]
    master.pending = [Start(**start) for start in saved["pending"]]
    master.placed = {(role, rank, inc): Placed(**placed) for role, rank, inc, placed in saved["placed"]}
    master.homes = {(role, rank): (node, port) for role, rank, node, port in saved["homes"]}
    master.stopping = {(role, rank, inc) for role, rank, inc in saved["stopping"]}
    master.lost = dict(saved["lost"])
    master.rooms.load_state(saved["rooms"])
    master.faults = [(node, cause) for node, cause in saved["faults"]]
    master.orders.load_state(saved["orders"])
    running = sum(1 for key in master.placed if master.is_current(key))
    return [Event("roles_resumed", f"the restarted master takes back {running} role process(es); "
                                   f"{len(master.pending)} wait to be placed", console=True)]
