"""Groups across roles (``convoy.join_group(["trainer", "rollout"])``), the master's side: who is in a group, its
version, each caller's rank, and where its rank 0 serves the group's store (pure; the processes form the group
themselves, with torch.distributed, from what this answers). A group's version changes whenever one of its roles
gains, loses or replaces a process; rank 0 of a version publishes its store's address for that version only."""

from __future__ import annotations

from convoy.control.protocol import roles as rp
from convoy.errors import ConfigError


class CrossGroups:
    """The addresses published per group and version (kept while the master runs; a restarted master's groups are
    published again as their members join again)."""

    def __init__(self) -> None:
        self.published: dict[str, tuple[str, str]] = {}
        """Group name -> (version, address of its rank 0's store)."""

    def view(self, name: str, roles: list[str], incarnations: dict[str, list[int]], known: list[str],
             caller: tuple[str, int, int]) -> rp.GroupView:
        """The group as the master sees it now, for ``caller`` (role, rank, incarnation); a ConfigError names a role
        the job does not have."""
        unknown = [role for role in roles if role not in known]
        if unknown:
            raise ConfigError(f"join_group({roles}): no role {unknown[0]!r} in this job (roles: {', '.join(known)})")
        if len(set(roles)) != len(roles):
            raise ConfigError(f"join_group({roles}): name each role once")
        members = rp.group_members(roles, incarnations)
        version = rp.group_version(members)
        rank = members.index(caller) if caller in members else -1
        held = self.published.get(name)
        address = held[1] if held is not None and held[0] == version else ""
        return rp.GroupView(name=name, version=version, rank=rank, world_size=len(members),
                            members=[f"{role}:{member_rank}" for role, member_rank, _ in members], address=address)

    def publish(self, view: rp.GroupView, version: str, address: str) -> None:
        """Rank 0 of the current version says where its store is; a ConfigError for anyone else or an old version."""
        if version != view.version:
            raise ConfigError(f"group {view.name!r} is at version {view.version}, not {version}: its members changed; "
                              "join again")
        if view.rank != 0:
            raise ConfigError(f"only rank 0 of group {view.name!r} publishes its store (this caller is rank "
                              f"{view.rank})")
        self.published[view.name] = (version, address)
