"""A process's role, as its environment says: torchrun's ROLE_NAME, ROLE_RANK and ROLE_WORLD_SIZE, plus the
addresses of every role's processes (``CONVOY_ROLE_ADDRESSES``). The agent writes these (``role_env``) and a
script reads them (``convoy.role()``); both sides of the contract live here. No torch."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from convoy.errors import ConfigError

ADDRESSES_ENV = "CONVOY_ROLE_ADDRESSES"
DEFAULT_ROLE = "default"


@dataclass(frozen=True)
class RoleInfo:
    """Who this process is among the job's roles."""

    name: str
    """The role's name (``default`` in a job that declares no roles)."""
    rank: int
    """This process's rank within its role, 0-based and stable across its restarts."""
    world_size: int
    """How many processes the role has now."""
    addresses: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Each role's processes' ``host:port`` by role rank (empty where the role publishes none)."""

    def peers(self, role: str) -> tuple[str, ...]:
        """The addresses of ``role``'s processes; a ConfigError naming the roles there are if it has none."""
        if not self.addresses.get(role):
            known = ", ".join(sorted(name for name, listed in self.addresses.items() if listed)) or "none"
            raise ConfigError(f"no addresses of role {role!r} in {ADDRESSES_ENV} (roles with addresses: {known}); "
                              "declare the role in the job file and give it a port")
        return self.addresses[role]


def role_env(name: str, rank: int, world_size: int, addresses: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """The variables that tell one process its role (written by the agent into a worker's environment)."""
    return {"ROLE_NAME": name, "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
            ADDRESSES_ENV: json.dumps({role: list(listed) for role, listed in addresses.items()}, sort_keys=True)}


def role(env: Mapping[str, str] | None = None) -> RoleInfo:
    """This process's role. Outside convoy (plain ``python``), torchrun's variables if set, else the one
    default role of size 1."""
    env = os.environ if env is None else env
    try:
        rank = int(env.get("ROLE_RANK", env.get("RANK", "0")))
        world_size = int(env.get("ROLE_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    except ValueError as exc:
        raise ConfigError(f"ROLE_RANK/ROLE_WORLD_SIZE are not whole numbers ({exc}); start the script with "
                          "convoy or torchrun") from exc
    raw = env.get(ADDRESSES_ENV, "{}")
    try:
        listed = json.loads(raw)
        addresses = {str(name): tuple(str(a) for a in entries) for name, entries in listed.items()}
    except (ValueError, AttributeError, TypeError) as exc:
        raise ConfigError(f"{ADDRESSES_ENV}={raw!r} is not a JSON object of role -> [host:port, ...]") from exc
    if not 0 <= rank < world_size:
        raise ConfigError(f"ROLE_RANK {rank} is outside ROLE_WORLD_SIZE {world_size}")
    return RoleInfo(env.get("ROLE_NAME", DEFAULT_ROLE), rank, world_size, addresses)
