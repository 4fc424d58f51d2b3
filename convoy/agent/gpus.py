"""The GPUs a node's agent may hand out to role processes, found without torch (the agent never imports it):
what CUDA_VISIBLE_DEVICES lists, else the devices NVIDIA's driver shows in /proc or /dev."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from convoy.errors import ConfigError

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")
DEVICE = re.compile(r"nvidia(\d+)")


def node_gpus(env: Mapping[str, str] | None = None, driver: Path = DRIVER_GPUS, dev: Path = Path("/dev")) -> list[str]:
    """The node's devices as CUDA names them for this agent: CUDA_VISIBLE_DEVICES's entries where it is set (an
    empty value or -1 hides them all), else one index per device the driver shows."""
    env = os.environ if env is None else env
    listed = env.get(VISIBLE_ENV)
    if listed is not None:
        entries = [entry.strip() for entry in listed.split(",") if entry.strip()]
        return entries[: next((i for i, entry in enumerate(entries) if entry == "-1"), len(entries))]
    try:
        count = sum(1 for _ in driver.iterdir())
    except OSError:
        count = sum(1 for entry in _names(dev) if DEVICE.fullmatch(entry))
    return [str(index) for index in range(count)]


def visible_devices(node: Sequence[str], handed: Sequence[int]) -> str:
    """A role process's CUDA_VISIBLE_DEVICES: the node's devices at the indices the master handed it."""
    return ",".join(node[index] for index in handed)


def _names(folder: Path) -> list[str]:
    try:
        return [entry.name for entry in folder.iterdir()]
    except OSError:
        return []


def check_local_gpus(roles: Sequence[tuple[str, int]], env: Mapping[str, str] | None = None) -> None:
    """Refuse, before anything starts, a role of a job whose nodes all run on this host that asks for more GPUs
    per process than the host has: ``roles`` are ``(name, gpus)``."""
    have = len(node_gpus(env))
    for name, gpus in roles:
        if gpus > have:
            shown = f" ({VISIBLE_ENV}={(env if env is not None else os.environ)[VISIBLE_ENV]!r})" \
                if VISIBLE_ENV in (env if env is not None else os.environ) else ""
            raise ConfigError(f"role {name!r}: gpus {gpus}: each process takes {gpus} GPU(s) and this host has "
                              f"{have}{shown}; lower the role's gpus, or run the job on nodes that have them")
