"""Whether convoy's agent can start its next workers without an import: read from /proc, as a benchmark waits
for it before a kill (a restart timed before the node is warm would time the import)."""

from __future__ import annotations

from pathlib import Path

import psutil

FORK_SERVER = "convoy.agent.forkserver"


def waiting_in(proc: psutil.Process, calls: tuple[str, ...]) -> bool:
    """Whether the process sleeps in one of the kernel's ``calls`` (its wchan)."""
    try:
        wchan = Path(f"/proc/{proc.pid}/wchan").read_text()
    except OSError:
        return False
    return any(call in wchan for call in calls)


def fork_servers(agent: psutil.Process) -> list[psutil.Process]:
    """The agent's fork servers: one it started (its child), or the one its launcher started for it and it took
    over (``--fork-server FD:PID`` on its command line; the launcher's child)."""
    command = agent.cmdline()
    servers = [child for child in agent.children() if FORK_SERVER in " ".join(child.cmdline())]
    if "--fork-server" in command[:-1]:
        adopted = int(command[command.index("--fork-server") + 1].rpartition(":")[2])
        try:
            server = psutil.Process(adopted)
            if FORK_SERVER in " ".join(server.cmdline()) and server.status() != psutil.STATUS_ZOMBIE:
                servers.append(server)
        except psutil.Error:
            pass  # gone: the agent runs one of its own now, among its children
    return servers


def agent_is_warm(agent: psutil.Process, workers: set[int], nproc: int) -> bool:
    """The agent's fork server waits in select(2) for an order (it has preloaded), or, where the workers are
    standbys of their own, ``nproc`` of them sit in read(2) on their stdin pipes."""
    try:
        idle = [child for child in agent.children() if child.pid not in workers]
        servers = fork_servers(agent)
    except psutil.Error:
        return False
    if servers:
        return all(waiting_in(server, ("select", "poll")) for server in servers)
    return len(idle) >= nproc and all(waiting_in(child, ("pipe_read",)) for child in idle)
