"""Simulated agents of a job of roles (``benchmarks/scale_roles.py``): each speaks the agent's protocol for roles
(``Agent._run_roles``) to a real master: join and wait for the first round, then heartbeats that carry the master's
orders and the roles' addresses; each process it is told to start is reported started at once (with an address of
its simulated host: nothing listens there), each it is told to stop is reported ended by SIGTERM, and a new round
is joined without a wait, as the agent does (it offers no port for the next round: no round store runs).

Agents holding the same addresses' version hold equal addresses, and changes sent to them are the same (one dict,
shared by ``sim_agents._whole``): each such change is applied once for all of them (``_applied``), as a real agent
applies its own on its own host."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from sim_agents import SimAgent

from convoy.control.protocol import messages as p

Key = tuple[str, int, int]
"""(role, rank, incarnation): one process."""
KEPT_APPLIED = 64
_APPLIED: dict[tuple[int, int], tuple[dict[str, Any], tuple[dict[str, list[str]], dict[str, list[int]]]]] = {}
"""(id of the shared changes, the version they apply to) -> (those changes, kept alive; what applying them gave)."""


def _applied(changes: dict[str, Any], held: int, addresses: dict[str, list[str]], incarnations: dict[str, list[int]]
             ) -> tuple[dict[str, list[str]], dict[str, list[int]]]:
    key = (id(changes), held)
    found = _APPLIED.get(key)
    if found is None or found[0] is not changes:
        found = _APPLIED[key] = (changes, p.AddressChanges.model_validate(changes).applied_to(addresses, incarnations))
        while len(_APPLIED) > KEPT_APPLIED:
            del _APPLIED[next(iter(_APPLIED))]
    return found[1]


@dataclass
class RoleSimAgent(SimAgent):
    next_port = 0
    addresses_version: int = 0
    addresses: dict[str, list[str]] = field(default_factory=dict)
    incarnations: dict[str, list[int]] = field(default_factory=dict)
    """The roles' addresses and incarnations by rank, as the master last sent them (whole, or what changed)."""
    orders: list[dict[str, Any]] = field(default_factory=list)
    """Assignments heard and not yet reported on."""
    stops: list[dict[str, Any]] = field(default_factory=list)
    """Stops heard and not yet reported on."""
    started: dict[Key, float] = field(default_factory=dict)
    """When this agent sent the report that each of its processes started (monotonic)."""
    complete: dict[int, float] = field(default_factory=dict)
    """Addresses version -> when this agent first held it with every rank's address set."""

    async def run(self) -> None:
        beating: asyncio.Task[None] | None = None
        try:
            round_id = await self._rendezvous(0)
            if round_id is None:
                return
            beating = asyncio.ensure_future(self._heartbeats())
            while not self.stopped:
                await self.moved.wait()
                self.moved.clear()
                if beating.done():
                    beating.result()
                while self.stops and not self.stopped:  # as the agent: stops first, then starts, then the round
                    await self._report_stopped(self.stops.pop(0))
                while self.orders and not self.stopped:
                    await self._report_started(self.orders.pop(0))
                if self.known_round > round_id and not self.stopped:
                    round_id = max(self.known_round, await self._join(self.known_round))
                    self.rounds[round_id] = time.monotonic()
        except Exception as exc:  # noqa: BLE001 (recorded: the benchmark says which agents failed and why)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.close(beating)

    async def _join(self, newest: int) -> int:
        """A new round of a job of roles: the node asks whether it is a member already (the master places the
        nodes that stay at once), else joins it; its processes go on."""
        status, placed = await self.link.call("/wait", {"node_id": self.node_id, "round_id": newest, "timeout_s": 0})
        if status == 200 and placed.get("state") == "ready":
            return newest
        status, joined = await self.link.call("/join", {"node_id": self.node_id, "host": "127.0.0.1", "nproc": 1,
                                                        "port": 29500, "instance": self.link.key})
        if status != 200:
            raise RuntimeError(f"join answered {status}: {joined}")
        return int(joined["round_id"])

    async def _report_started(self, assignment: dict[str, Any]) -> None:
        key = (assignment["role"], int(assignment["rank"]), int(assignment["incarnation"]))
        if key in self.started:  # delivered again before the report was heard: the agent ignores it too
            return
        port = assignment.get("port") or 20000 + key[1] % 40000
        sent = time.monotonic()  # (the process runs from here on; its report's answer may come after the wave)
        status, reply = await self.link.call("/role_report", {
            "node_id": self.node_id, "role": key[0], "rank": key[1], "incarnation": key[2], "state": "started",
            "address": f"{self.link.source or '127.0.0.1'}:{port}", "pid": 0})
        if status != 200:
            raise RuntimeError(f"role_report answered {status}: {reply}")
        self.started[key] = sent

    async def _report_stopped(self, stop: dict[str, Any]) -> None:
        key = (stop["role"], int(stop["rank"]), int(stop["incarnation"]))
        if self.started.pop(key, None) is None:
            return
        status, reply = await self.link.call("/role_report", {
            "node_id": self.node_id, "role": key[0], "rank": key[1], "incarnation": key[2], "state": "exited",
            "exitcode": -15, "signal": "SIGTERM"})
        if status != 200:
            raise RuntimeError(f"role_report answered {status}: {reply}")

    def beat_body(self, wait_s: float) -> dict[str, Any]:
        return {**super().beat_body(wait_s), "addresses_version": self.addresses_version}

    def heard(self, reply: dict[str, Any]) -> bool:
        news = False
        if reply.get("assignments") or reply.get("stops"):
            self.orders.extend(reply.get("assignments") or [])
            self.stops.extend(reply.get("stops") or [])
            news = True
        version = int(reply.get("addresses_version", 0))
        if version > self.addresses_version:
            changes = reply.get("address_changes")
            if changes is None:
                self.addresses, self.incarnations = reply.get("addresses") or {}, reply.get("incarnations") or {}
            elif changes["since"] == self.addresses_version:  # as the agent: applied to what it holds
                self.addresses, self.incarnations = _applied(changes, self.addresses_version, self.addresses,
                                                             self.incarnations)
            else:
                raise RuntimeError(f"changes since {changes['since']} sent to an agent holding "
                                   f"{self.addresses_version}")
            self.addresses_version = version
            if self.addresses and all(ranks and all(ranks) for ranks in self.addresses.values()):
                self.complete.setdefault(version, time.monotonic())
            news = True
        if news:
            self.moved.set()
        return news
