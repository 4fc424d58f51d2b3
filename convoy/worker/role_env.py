"""A process's role, as its environment says: torchrun's ROLE_NAME, ROLE_RANK and ROLE_WORLD_SIZE, plus the
addresses of every role's processes (``CONVOY_ROLE_ADDRESSES``, as they were at the start), and the file where
the agent keeps the current ones (``CONVOY_ROLE_ADDRESSES_FILE``: a process that moved, e.g. a restored PS on a
new port, is found there; ``RoleInfo.refresh()``). The agent writes these (``role_env``, ``write_addresses``)
and a script reads them (``convoy.role()``); both sides of the contract live here. No torch."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from convoy.errors import ConfigError

ADDRESSES_ENV = "CONVOY_ROLE_ADDRESSES"
ADDRESSES_FILE_ENV = "CONVOY_ROLE_ADDRESSES_FILE"
"""A JSON file ``{"version": n, "addresses": {role: [host:port, ...]}, "incarnations": {role: [n, ...]}}``, replaced
whole by the agent whenever the master's version of the addresses grows (``""`` for a process that is down)."""
INCARNATION_ENV = "CONVOY_ROLE_INCARNATION"
PREEMPT_FILE_ENV = "CONVOY_PREEMPT_FILE"
"""Where the agent writes this process's preemption notice (the file's existence is the notice)."""
"""Which launch of its rank this process is (the master's count, never reused within the role)."""
DEFAULT_ROLE = "default"
WAIT_FIRST_S, WAIT_MOST_S = 0.005, 0.05
"""``wait_changed`` reads the agent's file again after these pauses (growing): a change is seen within 50 ms."""


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
    addresses_file: str = ""
    """Where the agent keeps the current addresses (empty: outside convoy, the addresses never change)."""
    addresses_version: int = 0
    """The master's version of ``addresses`` (0: as the process's environment gave them)."""
    incarnation: int = 0
    """Which launch of its rank this process is (``CONVOY_ROLE_INCARNATION``; 0 outside a job of roles)."""
    incarnations: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Each role's current incarnation by rank, as of ``addresses_version`` (empty until the agent's file has
    them): a role service refuses a caller whose incarnation is no longer its rank's."""
    preempt_file: str = ""
    """Where this process's preemption notice appears (``CONVOY_PREEMPT_FILE``; empty outside a job of roles)."""

    @property
    def preempted(self) -> bool:
        """Whether a job of higher priority needs this process's CPUs: it is to finish its unit of work, flush, and
        exit (0); SIGTERM follows after the job's preempt grace. One ``stat`` of a file: cheap between units."""
        return bool(self.preempt_file) and os.path.exists(self.preempt_file)

    def refresh(self) -> RoleInfo:
        """This role with the current addresses and world size, read again from ``addresses_file`` (itself when
        the file is absent or not newer)."""
        if not self.addresses_file:
            return self
        published = read_published(Path(self.addresses_file))
        if published.version <= self.addresses_version:
            return self
        world_size = len(published.addresses.get(self.name, ())) or self.world_size
        return replace(self, addresses=published.addresses, addresses_version=published.version,
                       incarnations=published.incarnations, world_size=world_size)

    def wait_changed(self, timeout: float | None = None) -> RoleInfo | None:
        """This role again once any role's addresses or this role's world size differ from this one's (a process
        moved, started or stopped; the role was scaled); None when ``timeout`` seconds pass first. Outside a convoy
        job nothing ever changes: it waits out the timeout (None: a ConfigError, as it would wait for ever)."""
        if not self.addresses_file and timeout is None:
            raise ConfigError("wait_changed() without a timeout outside a convoy job of roles would never return; "
                              "give a timeout")
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        pause = WAIT_FIRST_S
        while True:
            fresh = self.refresh()
            if (fresh.addresses, fresh.world_size) != (self.addresses, self.world_size):
                return fresh
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, WAIT_MOST_S)

    def current_incarnation(self, role: str, rank: int) -> int | None:
        """The incarnation ``role`` rank ``rank`` runs as now, as far as this process has heard (None: not known,
        e.g. outside convoy or before the agent's first file)."""
        listed = self.incarnations.get(role, ())
        return listed[rank] if 0 <= rank < len(listed) else None

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


GROUP_ENV = "CONVOY_GROUP"
"""The role whose process group this process belongs to (set only for a role with ``group = true``)."""
GROUP_ROUND_ENV = "CONVOY_GROUP_ROUND"
"""The round of the role's group this process was started for (1, then one more each time the group re-forms)."""


def group_env(name: str, rank: int, world_size: int, group_round: int, host: str, port: int,
              group_address: str) -> dict[str, str]:
    """The torch.distributed world of a role group, as torchrun gives a job's: RANK and WORLD_SIZE are the role's,
    MASTER_ADDR:MASTER_PORT where its rank 0 serves the rendezvous (rank 0 itself: its own role port), and
    TORCHELASTIC_RESTART_COUNT counts the group's re-formings (what a script reads to know it was restarted)."""
    if rank == 0:
        master_host, master_port = host, str(port)
    else:
        master_host, _, master_port = group_address.rpartition(":")
        if not master_host or not master_port.isdigit():
            raise ConfigError(f"the group address {group_address!r} of role {name!r} is not host:port")
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": master_host, "MASTER_PORT": master_port,
            "TORCHELASTIC_RESTART_COUNT": str(group_round - 1), GROUP_ENV: name, GROUP_ROUND_ENV: str(group_round)}


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
    try:
        incarnation = int(env.get(INCARNATION_ENV, "0"))
    except ValueError as exc:
        raise ConfigError(f"{INCARNATION_ENV}={env[INCARNATION_ENV]!r} is not a whole number; it is set by the "
                          "convoy agent") from exc
    info = RoleInfo(env.get("ROLE_NAME", DEFAULT_ROLE), rank, world_size, addresses, env.get(ADDRESSES_FILE_ENV, ""),
                    incarnation=incarnation, preempt_file=env.get(PREEMPT_FILE_ENV, ""))
    return info.refresh()


def preempt_file(run_dir: Path, role_name: str, rank: int, incarnation: int) -> Path:
    """Where the agent writes one process's preemption notice."""
    return Path(run_dir) / "roles" / f"preempted-{role_name}{rank}-{incarnation}"


def addresses_file(run_dir: Path, node_id: str) -> Path:
    """The file where one node's agent keeps the current role addresses."""
    return Path(run_dir) / "roles" / f"addresses-{re.sub(r'[^A-Za-z0-9_.-]', '_', node_id)}.json"


@dataclass(frozen=True)
class Published:
    """What the agent's file holds: the master's version, each role's addresses and incarnations by rank."""

    version: int
    addresses: dict[str, tuple[str, ...]]
    incarnations: dict[str, tuple[int, ...]]


def write_addresses(path: Path, version: int, addresses: Mapping[str, Sequence[str]],
                    incarnations: Mapping[str, Sequence[int]] | None = None) -> None:
    """Replace the file at once (a reader sees the old whole file or the new one, never part of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps({"version": version, "addresses": {r: list(a) for r, a in addresses.items()},
                                   "incarnations": {r: list(i) for r, i in (incarnations or {}).items()}}))
    os.replace(partial, path)


def read_addresses(path: Path) -> tuple[int, dict[str, tuple[str, ...]]]:
    """``(version, addresses)`` from ``write_addresses``'s file; ``(0, {})`` when there is none yet."""
    published = read_published(path)
    return published.version, published.addresses


def read_published(path: Path) -> Published:
    """All of ``write_addresses``'s file, read once; version 0 and nothing else when there is none yet."""
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return Published(0, {}, {})
    except OSError as exc:
        raise ConfigError(f"cannot read the role addresses in {path}: {exc}") from exc
    try:
        data = json.loads(raw)
        version = int(data["version"])
        addresses = {str(name): tuple(str(a) for a in listed) for name, listed in data["addresses"].items()}
        incarnations = {str(name): tuple(int(i) for i in listed)
                        for name, listed in data.get("incarnations", {}).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path} does not hold role addresses ({exc}); it is written by the convoy agent "
                          f"({ADDRESSES_FILE_ENV}); do not edit it") from exc
    return Published(version, addresses, incarnations)


# --- The secret of the job's role services (agent -> process) -------------------------------------------------
# Every role service (a parameter server; later a replay buffer, a sample store, a weight sync) and its callers
# prove on connect that they hold one key (convoy/parallel/transport/). The agent derives it from the job's token,
# which therefore never reaches a process, and hands it to each role process with where to listen and whether the
# job runs with TLS.

SERVICE_SECRET_ENV = "CONVOY_ROLE_SECRET"
"""The key, 64 hex digits: ``service_secret(job token)``."""
SERVICE_TLS_ENV = "CONVOY_ROLE_TLS"
"""``1`` where the job runs with TLS (its agents reach the master through ``--tls-ca``): so do its role services."""
SERVICE_HOST_ENV = "CONVOY_ROLE_HOST"
"""The node's own address: a role service listens there (all interfaces only when its script asks)."""
SERVICE_SECRET_LABEL = b"convoy role services v1"


def service_secret(job_token: str) -> str:
    """The role services' key: HMAC-SHA256 of a fixed label under the job's token (one-way: holding the key
    gives no way back to the token, which alone reaches the master's API)."""
    return hmac.new(job_token.encode(), SERVICE_SECRET_LABEL, hashlib.sha256).hexdigest()


def service_env(job_token: str, host: str, tls: bool) -> dict[str, str]:
    """What the agent adds to a role process's environment for the job's role services (no key without a token)."""
    env = {SERVICE_HOST_ENV: host, SERVICE_TLS_ENV: "1" if tls else "0"}
    if job_token:
        env[SERVICE_SECRET_ENV] = service_secret(job_token)
    return env
