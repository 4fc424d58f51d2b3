"""Hosts on one machine: network namespaces around a bridge, for tests and benchmarks (needs root).

A hub namespace holds a bridge (address ``.1``); each host namespace joins it with a veth pair
(host ``i`` has address ``.i+2``). A host's link can be cut (its bridge end set down) or shaped
(``tc`` on its end, so everything the host sends out is slowed while its traffic to itself stays
on loopback). Removing the namespaces removes every link with them.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from types import TracebackType

SUBNET = "10.{}.{}.{}"


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)
    return done.stdout


def netns_problem() -> str | None:
    """Why network namespaces cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"cvprobe{uuid.uuid4().hex[:6]}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run 'ip netns add': {exc}"
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.decode(errors='replace').strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True, timeout=10)
    return None


class HostNetwork:
    """``hosts`` namespaces joined by a bridge in a hub namespace. Use as a context manager."""

    def __init__(self, hosts: int, prefix: str = "cv", second_octet: int = 77) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.prefix, self.second_octet = prefix, second_octet
        self.subnet = int(self.tag[:2], 16) % 200 + 20
        self.hub = f"{prefix}h{self.tag}"
        self.spaces: list[str] = []
        try:
            self._build(hosts)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self.remove()
            raise

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.remove()

    def address(self, index: int) -> str:
        """``.1`` is the hub; host ``i`` is ``.i+2``."""
        return SUBNET.format(self.second_octet, self.subnet, index)

    def host_address(self, host: int) -> str:
        return self.address(host + 2)

    def host_ns(self, host: int) -> str:
        return self.spaces[host + 1]

    def host_link(self, host: int) -> str:
        """The host's end of its veth pair, inside its namespace."""
        return f"e{host}{self.tag}"

    def _bridge_end(self, host: int) -> str:
        return f"b{host}{self.tag}"

    def _build(self, hosts: int) -> None:
        ip("netns", "add", self.hub)
        self.spaces.append(self.hub)
        ip("-n", self.hub, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "addr", "add", f"{self.address(1)}/24", "dev", "br0")
        ip("-n", self.hub, "link", "set", "br0", "up")
        for host in range(hosts):
            space, inner, outer = f"{self.prefix}{host}{self.tag}", self.host_link(host), self._bridge_end(host)
            ip("netns", "add", space)
            self.spaces.append(space)
            ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            ip("link", "set", inner, "netns", space)
            ip("link", "set", outer, "netns", self.hub)
            ip("-n", self.hub, "link", "set", outer, "master", "br0")
            ip("-n", self.hub, "link", "set", outer, "up")
            ip("-n", space, "addr", "add", f"{self.host_address(host)}/24", "dev", inner)
            ip("-n", space, "link", "set", inner, "up")
            ip("-n", space, "link", "set", "lo", "up")

    def set_link(self, host: int, up: bool) -> None:
        ip("-n", self.hub, "link", "set", self._bridge_end(host), "up" if up else "down")

    def shape(self, host: int, rate: str, delay: str) -> str:
        """Limit what ``host`` sends to the other hosts, e.g. ``rate="1gbit", delay="0.5ms"``; returns
        what was applied. ``tc netem`` gives rate and delay; a kernel without netem gets ``tbf``
        (rate only), and the answer says the delay is missing."""
        def tc(*qdisc: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["tc", "-n", self.host_ns(host), "qdisc", "replace", "dev", self.host_link(host),
                                   "root", *qdisc], check=False, capture_output=True, text=True, timeout=10)

        if tc("netem", "delay", delay, "rate", rate, "limit", "100000").returncode == 0:
            return f"netem: {rate}, {delay} delay"
        fallback = tc("tbf", "rate", rate, "burst", "256kb", "latency", "100ms")
        if fallback.returncode != 0:
            raise RuntimeError(f"tc cannot shape {self.host_link(host)}: {fallback.stderr.strip()}")
        return f"tbf: {rate}, no added delay (this kernel has no netem)"

    def sent_bytes(self, host: int) -> int:
        """Bytes ``host`` has sent over its link (to other hosts or the hub) so far."""
        shown = json.loads(ip("-n", self.host_ns(host), "-j", "-s", "link", "show", "dev", self.host_link(host)))
        return int(shown[0]["stats64"]["tx"]["bytes"])

    def exec_prefix(self, host: int | None) -> list[str]:
        """Run a command in a host's namespace (``None``: the hub's)."""
        return ["ip", "netns", "exec", self.hub if host is None else self.host_ns(host)]

    def remove(self) -> None:
        """Delete the namespaces; their veth pairs and the bridge go with them."""
        for space in self.spaces:
            subprocess.run(["ip", "netns", "del", space], check=False, capture_output=True, timeout=10)
        self.spaces = []
