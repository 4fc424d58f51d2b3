"""The environment a worker gets: torchrun's variables plus the documented CONVOY_* ones."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
from typing import TYPE_CHECKING

from convoy.worker.role_env import DEFAULT_ROLE, role_env

if TYPE_CHECKING:
    from convoy.control.protocol.messages import MemberInfo, RoundInfo


SIOCGIFADDR = 0x8915
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}
"""What a role process whose memory is measured or limited starts with: glibc hands large blocks back to the system
at once, so its memory stays flat after its first iteration instead of creeping, and the one measured iteration
stands for the rest (a value in the agent's env wins). Not for the others: each large tensor is then mapped and its
pages faulted in afresh (a GRPO trainer's step on SmolLM2 took 13.3 s with it against 10.4 s without, the
difference spent in the kernel)."""

SHARED_CORES = {"OMP_WAIT_POLICY": "PASSIVE"}
"""What role processes (and their node's fork server) start with: several share a node's cores, and an OpenMP
thread that spins at a barrier holds a core another process needs, so a waiting thread sleeps instead (a value in
the agent's env wins). A GRPO trainer's step on SmolLM2 with 2 threads, beside a process busy on one of 2 cores,
took 30 s spinning (libgomp's default) against 13 s passive; alone, 7.0 s against 7.3 s."""


def role_spawn_env(host: str | None = None) -> dict[str, str]:
    """What a role process starts with before its own variables (one thread unless its role says more)."""
    return {**SHARED_CORES, **spawn_env(1, host=host)}


def interface_of(address: str) -> str | None:
    """The network interface (Linux) whose IPv4 address is ``address``, or None."""
    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                info = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if info[20:24] == wanted:
                return name
    return None


def spawn_env(nproc_per_node: int, base: dict[str, str] | None = None, host: str | None = None) -> dict[str, str]:
    """What a standby starts with: the agent's environment plus settings read at import time.

    ``host`` is the address other nodes reach this one at. Unless ``GLOO_SOCKET_IFNAME`` is set,
    gloo is pointed at the interface that holds it: left alone, gloo advertises what the host name
    resolves to, which is often 127.0.0.1 and unreachable from other hosts."""
    env = dict(os.environ if base is None else base)
    if host and "GLOO_SOCKET_IFNAME" not in env:
        interface = interface_of(host)
        if interface is not None:
            env["GLOO_SOCKET_IFNAME"] = interface
    env["LOCAL_WORLD_SIZE"] = str(nproc_per_node)
    env.setdefault("PYTHONUNBUFFERED", "1")  # worker output reaches the console as it is printed
    if nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: one thread per worker unless told
    return env


def worker_env(
    round_info: RoundInfo, member: MemberInfo, local_rank: int, run_dir: str, master_url: str, log_file: str,
    role_name: str = DEFAULT_ROLE, round_store: bool = True,
) -> dict[str, str]:
    """The per-round variables for one worker (RANK, MASTER_PORT, ... and CONVOY_*); ``round_store``: rank 0's
    process serves the round's TCPStore (``round_store.py``), so every rank's ``init_process_group`` is its
    client, as under torchrun's agent store."""
    rank = member.rank_offset + local_rank
    topology = [[m.node_rank, m.host, m.nproc] for m in round_info.members]
    restart_count = str(round_info.restart_count)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(round_info.world_size),
        "LOCAL_WORLD_SIZE": str(member.nproc),
        "GROUP_RANK": str(member.node_rank),
        "GROUP_WORLD_SIZE": str(len(round_info.members)),
        **role_env(role_name, rank, round_info.world_size, {}),
        "MASTER_ADDR": round_info.master_addr,
        "MASTER_PORT": str(round_info.master_port),
        "TORCHELASTIC_RESTART_COUNT": restart_count,
        "TORCHELASTIC_MAX_RESTARTS": str(round_info.max_restarts),
        "TORCHELASTIC_RUN_ID": round_info.job_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(round_store),
        "CONVOY_JOB_ID": round_info.job_id,
        "CONVOY_ROUND": str(round_info.round_id),
        "CONVOY_RESTART_COUNT": restart_count,
        "CONVOY_RUN_DIR": run_dir,
        "CONVOY_NODE_ID": member.node_id,
        "CONVOY_NODE_RANK": str(member.node_rank),
        "CONVOY_NUM_NODES": str(len(round_info.members)),
        "CONVOY_TOPOLOGY": json.dumps(topology),
        "CONVOY_MASTER": master_url,
        "CONVOY_LOG_FILE": log_file,
        **({"CONVOY_RESTORE_AT_MOST": str(round_info.restore_at_most)} if round_info.restore_at_most is not None
           else {}),
    }
