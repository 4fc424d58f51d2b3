"""The calls a job's own processes make about its roles, through their agent's local API: scale a role
(``convoy.scale``) and read every role's counts (``convoy.roles()``). Each names its caller, so that a call of a
process that is no longer the job's is refused."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from convoy.control.protocol.base import Message

Count = Annotated[int, Field(ge=0, le=2**31)]
RoleName = Annotated[str, Field(min_length=1, max_length=32)]


class Caller(Message):
    """Which process asks (its role, rank and incarnation, as its environment says)."""

    caller_role: RoleName
    caller_rank: Count
    caller_incarnation: Count


class RoleScale(Caller):
    """Run ``count`` processes of ``role``, for ``reason`` (recorded in the job's events)."""

    role: RoleName
    count: Count = Field(le=100000)
    reason: str = Field(default="", max_length=500)


class RolesQuery(Caller):
    """Every role's counts, as the master holds them now."""


class RoleView(Message):
    """One role as the master holds it."""

    name: RoleName
    count: str = Field(default="", max_length=40, description="the role's declared count: N, MIN:MAX or auto")
    wanted: Count = Field(description="the count the role is to run now")
    running: Count = Field(description="processes that said they run")
    pending: Count = Field(description="processes waiting to be placed (for room, or for the roles they start after)")
    minimum: Count
    maximum: Count | None = Field(description="None: no upper bound (an auto role)")
    service: bool = False
    group_round: Count = Field(default=0, description="the round of the role's process group (0: no group)")
    failure_policy: str = ""
    restarts: Count = 0
    replacements: Count = 0
    preempted: Count = Field(default=0, description="processes given back to a job of higher priority")


class RolesView(Message):
    """Every role of the job; ``granted``: after a scale call, the count the role now wants."""

    roles: list[RoleView]
    granted: Count | None = None
    message: str = ""


GroupName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.+-]+$")]


class GroupJoin(Caller):
    """Join (or look up) the group ``name`` of every process of ``roles``: its version, this caller's rank in it, and
    where its rank 0 serves the group's store once it does."""

    name: GroupName
    roles: list[RoleName] = Field(min_length=1, max_length=16)


class GroupPublish(Caller):
    """Rank 0 of the group's ``version`` serves its store at ``address`` (host:port)."""

    name: GroupName
    version: str = Field(min_length=1, max_length=64)
    address: str = Field(min_length=3, max_length=300)


class GroupView(Message):
    name: GroupName
    version: str
    rank: int = Field(ge=-1, description="the caller's rank in the group (-1: not a member)")
    world_size: Count
    members: list[str] = Field(description="ROLE:RANK of every member, in rank order")
    address: str = Field(default="", description="where rank 0 of this version serves the store (empty: not yet)")


def group_members(roles: list[str], incarnations: dict[str, list[int]]) -> list[tuple[str, int, int]]:
    """The members of a group across ``roles``: every current process of each, in the order the roles are given,
    then by rank; ``incarnations``: each role's incarnation by rank, as the master publishes them."""
    return [(role, rank, incarnation) for role in roles
            for rank, incarnation in enumerate(incarnations.get(role, []))]


def group_version(members: list[tuple[str, int, int]]) -> str:
    """A version that changes whenever a member comes, goes or is replaced (a new incarnation of its rank)."""
    import hashlib

    text = ";".join(f"{role}:{rank}:{incarnation}" for role, rank, incarnation in members)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
