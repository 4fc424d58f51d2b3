"""A torch.distributed group across roles of one job: ``convoy.join_group(["trainer", "rollout"])``.

Every process of the named roles calls it; the master (through each process's agent) says who the members are
(every current process of those roles, in the order the roles are given, then by rank), the group's version, and
each caller's rank. Rank 0 serves the group's store on a free port of its node's address and publishes it for
that version; the others connect to it, and the group is a gloo process group of its own (``group.pg``: it does
not touch the default group, so a role group's processes can be in both). When a member comes, goes or is
replaced, the version changes: ``changed()`` says so from the agent's published incarnations (no call), and
``rejoin()`` forms the group again at the new version. This is what RLHF's weight push stands on.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from convoy.errors import ConfigError
from convoy.worker.role_env import SERVICE_HOST_ENV, role
from convoy.worker.scaling import group_call, group_version_now

WAIT_FIRST_S, WAIT_MOST_S = 0.01, 0.2


@dataclass
class CrossGroup:
    """One formed version of a group across roles."""

    name: str
    roles: tuple[str, ...]
    version: str
    rank: int
    world_size: int
    members: list[str]
    """ROLE:RANK of every member, in rank order."""
    pg: dist.ProcessGroup
    timeout_s: float
    store: dist.Store = field(repr=False)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``tensor`` from group rank ``src`` to every member, in place."""
        self.pg.broadcast(tensor, src).wait()
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the members, in place."""
        self.pg.allreduce([tensor]).wait()
        return tensor

    def changed(self) -> bool:
        """Whether the group's members have changed since it formed (one read of the agent's published file)."""
        now = group_version_now(self.roles)
        return now is not None and now != self.version

    def rejoin(self) -> CrossGroup:
        """The group formed again at its current version (every member calls it once it sees ``changed()``)."""
        return join_group(self.roles, self.name, self.timeout_s)


def join_group(roles: Sequence[str], name: str | None = None, timeout: float = 120.0) -> CrossGroup:
    """Form (or join) the group of every process of ``roles``; every one of them calls it. A ConfigError names why a
    process cannot (a role the job does not have, this process not one of them, outside a convoy job, the group not
    formed within ``timeout`` seconds)."""
    roles = tuple(roles)
    name = name or "+".join(roles)
    deadline, pause = time.monotonic() + timeout, WAIT_FIRST_S
    while True:
        view = group_call("/groups/join", {"name": name, "roles": list(roles)})
        if view.rank < 0:
            me = role()
            raise ConfigError(f"convoy.join_group({list(roles)}): this process ({me.name} {me.rank}) is not a process "
                              "of those roles; only their processes join it")
        if view.rank == 0 and not view.address:
            host = os.environ.get(SERVICE_HOST_ENV, "127.0.0.1")
            store = dist.TCPStore(host, 0, view.world_size, True, timeout=datetime.timedelta(seconds=timeout),
                                  wait_for_workers=False)
            view = group_call("/groups/publish", {"name": name, "version": view.version,
                                                  "address": f"{host}:{store.port}"})
            break
        if view.address:
            host, _, port = view.address.rpartition(":")
            store = dist.TCPStore(host, int(port), view.world_size, False, timeout=datetime.timedelta(seconds=timeout))
            break
        if time.monotonic() + pause > deadline:
            raise ConfigError(f"group {name!r} did not form within {timeout:g} s: its rank 0 ({view.members[0]}) has "
                              "not joined; every process of the roles must call convoy.join_group")
        time.sleep(pause)
        pause = min(pause * 2, WAIT_MOST_S)
    prefixed = dist.PrefixStore(f"convoy-group/{name}/{view.version}/", store)
    pg = dist.ProcessGroupGloo(prefixed, view.rank, view.world_size, datetime.timedelta(seconds=timeout))
    return CrossGroup(name, roles, view.version, view.rank, view.world_size, list(view.members), pg, timeout, store)
