"""Ports and addresses, for the launcher, the agent and the workers alike (no torch, no third-party imports)."""

from __future__ import annotations

import socket
from collections.abc import Iterable

PORT_TAKEN_MARKS = ("eaddrinuse", "address already in use")
"""How torch's TCPStore (and the OS) say that a port to listen on is taken."""


def free_port(host: str = "", port: int = 0) -> int:
    """``port`` if it is free on ``host`` now, or any free port for 0; OSError if it is taken. Free now is
    not free later: a caller that must keep it uses ``hold_port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, port))
        return int(sock.getsockname()[1])


def hold_port(host: str = "", port: int = 0, listen: bool = False) -> socket.socket:
    """A socket bound to a port that is free now (``port``, or any): no other bind gets that port until it is
    closed, just before the workers start, or handed to the process that serves the round's store on it
    (the round's MASTER_PORT candidate); ``listen``: it listens, so connections wait in its queue."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        if listen:
            sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def port_taken(log_lines: Iterable[str]) -> bool:
    """Whether a worker's last lines say it could not listen because its port was taken."""
    return any(mark in line.lower() for line in log_lines for mark in PORT_TAKEN_MARKS)


def local_address_towards(host: str, port: int) -> str:
    """The address of this host that the master (and so other nodes) can reach."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, port))
            return str(sock.getsockname()[0])
        except OSError:
            return socket.gethostname()
