"""Role groups start whole (gang placement). A group's members form one torch.distributed world of their own, so a
member placed without the others would wait in its rendezvous for them, holding its share of the pool meanwhile.

- A group grows only when all its new members have room now (the nodes' and the pool's); otherwise the request is
  refused, naming the room there is, and the group runs on at its size (``convoy scale`` answers 409, and
  ``convoy.scale`` raises a ConfigError the caller can act on).
- A round of a group whose pending members cannot all be placed (a node lost, room taken meanwhile) waits whole,
  said once; what it waits for from the pool is claimed, so that jobs of lower priority give it back.

Called by ``RoleMaster`` under its lock."""

from __future__ import annotations

from typing import Protocol

from convoy.control.job import Event
from convoy.control.pool.claims import total
from convoy.control.pool.scheduler import Scheduler
from convoy.control.roles.members import Roles, Start
from convoy.control.roles.orders import Key
from convoy.control.roles.placement import Need, Rooms, Taken, describe_room, room_for_all
from convoy.roles_config import RoleSpec


class RoleMaster(Protocol):
    """What of ``control/roles/master.py``'s RoleMaster this reads (named here: the master imports this module)."""

    roles: Roles
    specs: dict[str, RoleSpec]
    begun: bool
    pending: list[Start]
    rooms: Rooms
    scheduler: Scheduler
    pool_waiting: set[Key]

    def need(self, role: str, rank: int) -> Need: ...
    def is_current(self, key: Key) -> bool: ...
    def live_nodes(self) -> list[str]: ...
    def taken(self) -> dict[str, Taken]: ...


def growth_refused(master: RoleMaster, role: str, count: int) -> str:
    """Why the group ``role`` cannot grow to ``count`` now ('' when it can, or is no group, or does not grow)."""
    state = master.roles.roles[role]
    new = [rank for rank in range(count) if rank not in state.members]
    if not state.spec.group or not new or not master.begun:
        return ""
    needs = [master.need(role, rank) for rank in new]
    nodes, taken = master.live_nodes(), master.taken()
    if nodes and not room_for_all(needs, nodes, master.rooms.nodes, taken):
        where = f"the nodes have {describe_room(nodes, master.rooms.nodes, taken)}"
    elif not total(need.amount() for need in needs).within(master.scheduler.room()):
        where = f"the pool has {master.scheduler.room().describe()} free for this job"
    else:
        return ""
    return (f"role {role} is a group whose members start together: {len(new)} more process(es) of "
            f"{needs[0].describe()} each have no room now ({where}); it runs on with {len(state.members)}")


def placed_whole(master: RoleMaster, role: str, nodes: list[str], taken: dict[str, Taken]) -> tuple[bool, list[Event]]:
    """Whether the group ``role``'s pending members may be placed now (all of them have room beside ``taken``), and
    otherwise the line said once."""
    starts = [start for start in master.pending
              if start.role == role and master.is_current((start.role, start.rank, start.incarnation))]
    needs = [master.need(role, start.rank) for start in starts]
    on_nodes = room_for_all(needs, nodes, master.rooms.nodes, taken)
    if not needs or (on_nodes and total(need.amount() for need in needs).within(master.scheduler.room())):
        return True, []
    keys = {(start.role, start.rank, start.incarnation) for start in starts}
    if on_nodes:
        master.pool_waiting |= keys  # claimed from the pool: jobs of lower priority give it back
    if keys & master.rooms.told_waiting:
        return False, []
    master.rooms.told_waiting |= keys
    return False, [Event("role_waits", f"role {role}'s group of {len(starts)} waits for room for all its members at "
                         f"once ({needs[0].describe()} each); the nodes have "
                         f"{describe_room(nodes, master.rooms.nodes, taken)}", console=True)]
