"""Scaling a job's roles from inside the job: ``convoy.scale(role, count, reason)`` and ``convoy.roles()``.

A process of a job of roles calls its node's agent (``CONVOY_AGENT_URL``, with the node's agent token), which
forwards to the master with the job's token: the process never holds that token. Each call names its caller
(role, rank, incarnation), so a process that is no longer the job's is refused, and every scaling is an event
naming who asked and why. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from convoy.control.protocol import roles as rp
from convoy.errors import ConfigError
from convoy.worker.role_env import INCARNATION_ENV, role
from convoy.worker.shards import AGENT_TOKEN_ENV, AGENT_URL_ENV, AgentBackend


@dataclass(frozen=True)
class RoleCounts:
    """One role as the master holds it."""

    name: str
    wanted: int
    """The count the role is to run now (after ``convoy.scale``: what was granted)."""
    running: int
    pending: int
    """Processes starting, or waiting for room or for the roles they start after."""
    minimum: int
    maximum: int | None
    service: bool = False
    group_round: int = 0
    failure_policy: str = ""
    restarts: int = 0
    replacements: int = 0
    preempted: int = 0


def scale(role_name: str, count: int, reason: str = "", env: Mapping[str, str] | None = None) -> RoleCounts:
    """Run ``count`` processes of ``role_name`` (within its MIN:MAX); returns the role as the master now holds it:
    ``wanted`` is the count granted, ``running`` and ``pending`` say how far the processes are. A count the role
    cannot take (beyond MAX, below MIN, a role whose count is fixed) raises a ConfigError naming why."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise ConfigError(f"convoy.scale({role_name!r}, {count!r}): give the count as a whole number")
    if count < 0:
        raise ConfigError(f"convoy.scale({role_name!r}, {count}): a count is 0 or more")
    backend, caller = _backend("convoy.scale", env)
    answer = backend.call("/roles/scale", rp.RoleScale(**caller, role=role_name, count=count, reason=reason[:500]),
                          rp.RolesView)
    if isinstance(answer, str):
        raise ConfigError(answer)
    return next(counts for counts in _counts(answer) if counts.name == role_name)


def roles(env: Mapping[str, str] | None = None) -> dict[str, RoleCounts]:
    """Every role of the job, by name: wanted, running and pending counts, and what its failures cost."""
    backend, caller = _backend("convoy.roles()", env)
    answer = backend.call("/roles/list", rp.RolesQuery(**caller), rp.RolesView)
    if isinstance(answer, str):
        raise ConfigError(answer)
    return {counts.name: counts for counts in _counts(answer)}


def group_call(path: str, request: dict[str, object], env: Mapping[str, str] | None = None) -> rp.GroupView:
    """One call of a group across roles (``/groups/join`` or ``/groups/publish``) as this process; a refusal raises
    a ConfigError naming why (``convoy.join_group`` is built on it)."""
    backend, caller = _backend("convoy.join_group", env)
    model = rp.GroupJoin if path == "/groups/join" else rp.GroupPublish
    answer = backend.call(path, model(**caller, **request), rp.GroupView)
    if isinstance(answer, str):
        raise ConfigError(answer)
    return answer


def group_version_now(roles: Sequence[str]) -> str | None:
    """The version of the group across ``roles`` as the agent's published incarnations show it now (None: nothing
    published yet, e.g. outside a job)."""
    published = role().incarnations
    if not published:
        return None
    return rp.group_version(rp.group_members(list(roles), {name: list(published.get(name, ())) for name in roles}))


def _counts(view: rp.RolesView) -> list[RoleCounts]:
    return [RoleCounts(**row.model_dump(exclude={"count"})) for row in view.roles]


def _backend(what: str, env: Mapping[str, str] | None) -> tuple[AgentBackend, dict[str, object]]:
    env = os.environ if env is None else env
    url = env.get(AGENT_URL_ENV)
    if not url or INCARNATION_ENV not in env:
        raise ConfigError(f"{what} works in a process of a convoy job of roles ({AGENT_URL_ENV} and {INCARNATION_ENV} "
                          "are not set here); from outside the job, run: convoy scale --run-dir RUN_DIR ROLE=COUNT")
    info = role(env)
    caller = {"caller_role": info.name, "caller_rank": info.rank, "caller_incarnation": info.incarnation}
    return AgentBackend(url, env.get(AGENT_TOKEN_ENV, "")), caller
