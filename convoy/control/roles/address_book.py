"""The roles' addresses as the nodes' heartbeats carry them: published in waves, and sent as what changed since the
version a node holds.

Each process that starts or moves changes the addresses, and every node is told. Told at once, each change would
answer every parked heartbeat: N² replies while N processes start, each with all N addresses (at 256 nodes the
master spent two thirds of its time there and a heartbeat's p99 was 115 ms). The book publishes at most one wave
per ``wave_for(N)`` seconds, so the changes that come together go out together, and a node holding one of the
last ``KEPT_WAVES`` waves is sent only the entries that changed since. Pure: ``NodePolls`` says when a wave is
published and asks what a node is sent."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from convoy.control.replies import Tail

WAVE_REPLIES_PER_S = 1000.0
"""A wave answers every node: waves come at most as often as keeps these replies a second (at ~0.5 ms each, a
quarter of the master's two cores), and at once where the last one is that old (a small job is told at once)."""
KEPT_WAVES = 8
"""Waves a node may hold and still be sent only the changes (an older one is sent everything)."""


def wave_for(nodes: int) -> float:
    """The least time between two waves at ``nodes`` nodes."""
    return nodes / WAVE_REPLIES_PER_S


@dataclass(frozen=True)
class Wave:
    """Every role's addresses and incarnations by rank, at one version."""

    version: int = 0
    addresses: dict[str, list[str]] = field(default_factory=dict)
    incarnations: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Changes:
    """From the wave ``since`` to ``version``: every role's number of ranks, and the entries that changed, by index."""

    since: int
    version: int
    sizes: dict[str, int]
    addresses: dict[str, dict[int, str]]
    incarnations: dict[str, dict[int, int]]


def changes(base: Wave, wave: Wave) -> Changes:
    """What a node holding ``base`` needs to hold ``wave``."""
    return Changes(base.version, wave.version, {role: len(ranks) for role, ranks in wave.addresses.items()},
                   _changed(base.addresses, wave.addresses), _changed(base.incarnations, wave.incarnations))


def _changed(base: dict[str, list], now: dict[str, list]) -> dict[str, dict[int, object]]:
    found = {}
    for role, entries in now.items():
        before = base.get(role, [])
        changed = {i: entry for i, entry in enumerate(entries) if i >= len(before) or before[i] != entry}
        if changed:
            found[role] = changed
    return found


class AddressBook:
    """The current wave, the few before it, and the changes from each of those to it (made once per wave)."""

    def __init__(self) -> None:
        self.wave = Wave()
        self.looked_at = -math.inf
        """When the roles' addresses were last looked at for a wave (making one costs O(processes))."""
        self._kept: dict[int, Wave] = {}
        self._changes: dict[int, Changes] = {}
        self._tails: dict[int, Tail] = {}
        """What ``tail`` made for each version a node held, for the current wave."""

    def due(self, now: float, wave_s: float) -> bool:
        """Whether the addresses may be looked at for a new wave now."""
        return now - self.looked_at >= wave_s

    def publish(self, wave: Wave, now: float) -> bool:
        """Make ``wave`` (the roles' newest addresses, looked at ``now``) the current one; False where it is the
        current one."""
        self.looked_at = now
        if wave.version == self.wave.version:
            return False
        if self.wave.version:  # (a node holding none is sent the whole wave)
            self._kept[self.wave.version] = self.wave
        while len(self._kept) > KEPT_WAVES:
            del self._kept[min(self._kept)]
        self.wave, self._changes, self._tails = wave, {}, {}
        return True

    def for_node(self, held: int) -> Wave | Changes | None:
        """What a node holding version ``held`` is sent: nothing (it holds the current wave), the changes since
        its wave (one of the last few), or the whole wave."""
        if held == self.wave.version:
            return None
        base = self._kept.get(held)
        if base is None:
            return self.wave
        found = self._changes.get(held)
        if found is None:
            found = self._changes[held] = changes(base, self.wave)
        return found

    def encoded(self, held: int) -> bytes:
        """``for_node(held)`` as the members of a heartbeat reply's JSON object (``"addresses":..,"incarnations":..``
        or ``"address_changes":..``; empty for nothing), made once per wave and version held: at thousands of
        processes a wave's addresses are the bulk of every reply, the same for every node."""
        return bytes(self.tail(held)[:-1])

    def tail(self, held: int) -> Tail:
        """``encoded(held)`` closing a reply's JSON object: the tail of every reply to a node holding ``held``,
        made once per wave and version held and compressed once (``replies.Joined``)."""
        found = self._tails.get(held)
        if found is None:
            sent = self.for_node(held)
            if isinstance(sent, Changes):
                fields = {key: value for key, value in asdict(sent).items() if key != "version"}
                members = b'"address_changes":' + json.dumps(fields, separators=(",", ":")).encode()
            elif isinstance(sent, Wave):
                members = json.dumps({"addresses": sent.addresses, "incarnations": sent.incarnations},
                                     separators=(",", ":")).encode()[1:-1]
            else:
                members = b""
            found = self._tails[held] = Tail(members + b"}")
        return found
