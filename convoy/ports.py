"""Ports and addresses, for the launcher, the agent and the workers alike (no torch, no third-party imports)."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable
from pathlib import Path

PORT_TAKEN_MARKS = ("eaddrinuse", "address already in use")
"""How torch's TCPStore (and the OS) say that a port to listen on is taken."""


def free_port(host: str = "", port: int = 0) -> int:
    """``port`` if it is free on ``host`` now, or any free port for 0; OSError if it is taken. Free now is
    not free later: a caller that must keep it uses ``hold_port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, port))
        return int(sock.getsockname()[1])


OUTGOING_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""The kernel's range for the local ports of outgoing connections (and of binds to port 0)."""
FIRST_UNCLAIMED = 20000
"""The lowest port ``unclaimed_port`` picks: below are the ranges other systems take by default (Ray's workers
10002-19999, databases, well-known services)."""
PICKS = 64
"""How many random ports ``unclaimed_port`` tries before it takes any free one."""


def can_listen(port: int) -> bool:
    """Whether a server could listen on ``port`` now on every address, as torch's TCPStore does: it binds the
    wildcard address with SO_REUSEADDR, so a socket on any one address (the host's own, not only the loopback)
    takes the port from it, and connections of an old process lingering in TIME_WAIT do not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
            sock.listen(1)
        except OSError:
            return False
        return True


def outgoing_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections, (32768, 60999) where it cannot be read."""
    try:
        low, high = (int(part) for part in OUTGOING_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def unclaimed_port(host: str = "") -> int:
    """A port a server can listen on now, for a process that binds it later: picked outside the kernel's range
    for outgoing connections, so that no connection made in between (by any process on the host) takes it, as
    one may take a port that binding to 0 gave. Any free port where that leaves none."""
    low, high = outgoing_range()
    spans = [(FIRST_UNCLAIMED, low), (high + 1, 65536)]
    candidates = [span for span in spans if span[1] > span[0]]
    if candidates:
        chooser = random.SystemRandom()
        for _ in range(PICKS):
            start, end = chooser.choice(candidates)
            port = chooser.randrange(start, end)
            if can_listen(port):
                return port
    return free_port(host)


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
