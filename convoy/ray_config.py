"""The settings of a job that Ray places (``convoy run --scheduler ray``): where its cluster is, how long placing
MIN nodes may take, and what each node's agent holds there."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from convoy.errors import ConfigError
from convoy.roles_config import RoleSpec, parse_memory

SCHEDULERS = ("local", "ray")
RESOURCE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,63}")
BUILT_IN = ("CPU", "GPU", "memory", "object_store_memory")


@dataclass
class RayConfig:
    address: str = "auto"
    """``auto`` (the cluster this machine's ``ray start`` joined, or $RAY_ADDRESS) or the head's HOST:PORT."""
    placement_timeout_s: float = 5.0
    """How long the cluster may lack MIN nodes with room for the job's share before the job fails, naming what is
    missing (a node that joins in that time counts)."""
    cpus: float = 0.0
    """CPUs each node's agent holds (0: the job's own: one per worker process, or its roles' CPUs per node)."""
    gpus: float = 0.0
    """GPUs each node's agent holds (0: the job's roles' GPUs per node, else none)."""
    memory_bytes: int = 0
    """Memory each node's agent holds in Ray's accounts (0: none asked)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom resources each node's agent holds (a node type's, to place the job on those nodes only)."""

    def validate(self) -> None:
        if not self.address:
            raise ConfigError("--address: give auto or the Ray head's HOST:PORT")
        if not math.isfinite(self.placement_timeout_s) or self.placement_timeout_s <= 0:
            raise ConfigError(f"--placement-timeout {self.placement_timeout_s}: need seconds > 0")
        for flag, amount in (("--ray-cpus", self.cpus), ("--ray-gpus", self.gpus)):
            if not math.isfinite(amount) or amount < 0:
                raise ConfigError(f"{flag} {amount}: need a number >= 0")
        for name, amount in self.resources.items():
            if not RESOURCE_NAME.fullmatch(name) or name in BUILT_IN:
                raise ConfigError(f"--ray-resource {name}: not a custom resource name (letters, digits, _ . : -; "
                                  f"not one of {', '.join(BUILT_IN)}, which have their own flags)")
            if not math.isfinite(amount) or amount <= 0:
                raise ConfigError(f"--ray-resource {name}={amount}: need an amount > 0")

    def node_cpus(self, nproc_per_node: int, roles: tuple[RoleSpec, ...], min_nodes: int) -> float:
        """The CPUs one agent holds: as set, else one per worker process, or the CPUs the roles declare at their
        MIN counts shared over MIN nodes (at least 1)."""
        if self.cpus:
            return self.cpus
        if not roles:
            return float(nproc_per_node)
        return float(max(1, math.ceil(sum((role.cpus or 0) * role.count.minimum for role in roles) / min_nodes)))

    def node_gpus(self, roles: tuple[RoleSpec, ...], min_nodes: int) -> float:
        if self.gpus:
            return self.gpus
        return float(math.ceil(sum(role.gpus * role.count.minimum for role in roles) / min_nodes))


def parse_resources(items: list[str]) -> dict[str, float]:
    """``NAME=AMOUNT`` items (``--ray-resource``) into a dict."""
    resources = {}
    for item in items:
        name, sep, amount = item.partition("=")
        try:
            resources[name.strip()] = float(amount) if sep else float("nan")
        except ValueError:
            raise ConfigError(f"--ray-resource {item!r}: give NAME=AMOUNT, e.g. trainer_node=1") from None
        if not sep:
            raise ConfigError(f"--ray-resource {item!r}: give NAME=AMOUNT, e.g. trainer_node=1")
    return resources


def parse_size(value: str, flag: str) -> int:
    """A memory size with its unit given to ``flag`` (``--ray-memory 2GiB``), in bytes; empty: 0 ('auto' refused)."""
    if not value:
        return 0
    size, auto = parse_memory(value)
    if auto or size is None:
        raise ConfigError(f"{flag} {value!r}: give a size, e.g. 4GiB")
    return size


def check_scheduler(name: str) -> str:
    if name not in SCHEDULERS:
        raise ConfigError(f"--scheduler {name!r}: choose one of {', '.join(SCHEDULERS)}")
    return name
