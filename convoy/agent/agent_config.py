"""What one agent is told at its start: its master, its node, its run dir and its workers."""

from __future__ import annotations

import fcntl
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from convoy.config import WorkerConfig


@dataclass
class AgentConfig:
    master_host: str
    master_port: int
    token: str
    node_id: str
    host: str
    """The address other nodes reach this one at (MASTER_ADDR when it gets node rank 0)."""
    run_dir: Path
    workers: WorkerConfig
    heartbeat_s: float = 1.0
    master_timeout_s: float = 30.0
    """How long the master may be unreachable before the agent stops its workers and exits."""
    tls_ca: str = ""
    """Speak TLS to the master and trust its certificate if this CA signed it (empty: plain HTTP)."""
    node_rank: int = -1
    """The node rank this agent asks for in a first round (torchrun's --node-rank); -1: the master's join order."""
    cpus: int = 0
    """The CPUs this node offers role processes (0: the agent's CPU affinity)."""
    roles: bool = False
    """The job runs roles (known at the start where the launcher's roles file is in the run dir): no standby per
    local rank, but a fork server from the first join on (a job found to have roles later starts it then)."""


_slot_locks: list[int] = []
"""The slot files this process holds (open, locked) for its life."""


def default_node_id(run_dir: Path, most: int = 1024) -> str:
    """``HOST-SLOT``: the lowest slot of this host no live agent of the run dir holds (a lock on
    ``RUN_DIR/nodes/HOST-SLOT.lock``, held for the agent's life and released by its death, even by SIGKILL), so
    an agent started again on the same host gets its predecessor's node id and finds its snapshots."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip(".-") or "node"
    folder = Path(run_dir) / "nodes"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for slot in range(most):
        fd = os.open(folder / f"{host}-{slot}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        _slot_locks.append(fd)
        return f"{host}-{slot}"
    raise ValueError(f"{most} agents of this host already hold a slot in {folder}")

