"""A role process's link to the replay service: inserts that land exactly once across a restart of the buffer,
samples, priorities, weights by version, the slices' deal and the stats.

An actor's inserts carry its count of transitions before each batch. It keeps every batch the buffer has not yet
reported kept in a snapshot; when the buffer comes back from a snapshot (restarted, or moved to another node:
the client finds it at the role's published address) it answers ``resend`` from its count, and the client sends
the kept batches again from there, so nothing the actor still holds is lost and nothing lands twice.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from convoy.errors import ConfigError
from convoy.parallel.transport import Connection, ConnectionLost, Credentials, Message, TransportError
from convoy.parallel.transport.connection import REQUEST_S
from convoy.workloads.rl.ring import SharedRing

FIND_S = 60.0
"""How long a call looks for the replay service (restarting, or not yet published) before it gives up."""
LANE_BYTES = 0
"""No shared-memory lane by default: for the replay's messages it did not pay on a 2-core machine (0.86-0.96x the
socket, benchmarks/results/rl.txt); the samples, the bulk of the bytes, come from the shared ring instead."""


class ReplayClient:
    """``address`` is asked again (``find``) whenever the service cannot be reached: a restarted replay may serve
    at a new address, published to the job's processes."""

    def __init__(self, find: Callable[[], str], credentials: Credentials | None = None, find_s: float = FIND_S,
                 request_s: float = REQUEST_S, lane_bytes: int = LANE_BYTES, direct: bool = True) -> None:
        """``find``: the service's address now; ``find_s``: how long to keep trying to reach it; ``request_s``: how
        long one request may take before the connection is given up and the request sent again (a stopped service:
        a batch sent again is kept once); ``lane_bytes``: the tensors go through a shared-memory lane of that size
        when the service is on this host (0: on the socket); ``direct``: samples are gathered here from the service's
        shared ring when this host has it (the service sends only the slots)."""
        self.find, self.credentials, self.find_s, self.request_s = find, credentials, find_s, request_s
        self.lane_bytes, self.direct = lane_bytes, direct
        self.ring: SharedRing | None = None
        self.ring_why = ""
        """Why samples are not gathered from the shared ring ('' while they are, or before the first sample)."""
        self._ring_looked = -1
        """The connection (by ``reconnects``) on which the ring was last looked for."""
        self.torn = 0
        """Drawn rows dropped because the ring overwrote them while this process copied them."""
        self.conn: Connection | None = None
        self.sent = 0
        """This process's transitions accepted by the buffer (the next batch's ``first``)."""
        self.unkept: deque[tuple[int, dict[str, torch.Tensor], dict[str, Any]]] = deque()
        """Batches (with their ``first`` and what they finished) not yet in a snapshot of the buffer: sent again
        after its restart (what they finished died with the buffer's counts too)."""
        self.resent = 0
        """Batches sent again to a buffer that came back from a snapshot."""
        self.lost = 0
        """Transitions a restarted buffer lost that this process no longer held to send again."""
        self.reconnects = 0

    def call(self, message: Message) -> Message:
        """One request, reconnecting (to the address ``find`` gives now) until ``find_s`` has passed."""
        deadline = time.monotonic() + self.find_s
        while True:
            try:
                if self.conn is None:
                    address = self.find()
                    if not address:
                        raise ConnectionLost("the replay service has published no address yet")
                    self.conn = Connection(address, self.request_s, credentials=self.credentials,
                                           service="replay service", lane_bytes=self.lane_bytes)
                    self.reconnects += 1
                return self.conn.request(message)
            except (ConnectionLost, OSError) as exc:
                self.close()
                if time.monotonic() > deadline:
                    raise ConfigError(f"the replay service could not be reached for {self.find_s:.0f} s: "
                                      f"{exc}") from exc
                time.sleep(0.2)

    def insert(self, batch: dict[str, torch.Tensor], returns: list[float] | None = None, env_steps: int = 0,
               visits: dict[int, int] | None = None) -> dict[str, Any]:
        """Send one batch with what it finished (episode returns, environment steps, episodes per slice); batches
        lost with a restarted buffer are sent again first. Returns the buffer's answer (``have``: this process's
        transitions it holds, ``env_steps``: the whole job's)."""
        first = self.sent
        news = {"returns": returns or [], "env_steps": env_steps,
                "visits": {str(k): v for k, v in (visits or {}).items()}}
        self.unkept.append((first, batch, news))
        reply = self._insert(first, batch, news)
        while reply.op == "resend":
            reply = self._resend_from(int(reply.meta["from"]))
        self.sent = int(reply.meta["have"])
        return dict(reply.meta)

    def _insert(self, first: int, batch: dict[str, torch.Tensor], news: dict[str, Any]) -> Message:
        while True:
            reply = self.call(Message("insert", {"first": first, **news}, batch))
            if reply.op != "wait":  # a throttled insert waits at the service, then asks again
                break
        if reply.op == "inserted":
            self._forget_kept(int(reply.meta["kept"]), int(reply.meta.get("capacity", 0)))
        return reply

    def _resend_from(self, have: int) -> Message:
        """Send the batches not yet kept again, from the buffer's count ``have``; the last reply. Transitions the
        buffer lost that this process no longer holds (a buffer restarted from an older snapshot, or from none)
        are counted in ``lost`` and the rest are numbered on from ``have``."""
        batches = [entry for entry in self.unkept if entry[0] + _rows(entry[1]) > have]
        if not batches or batches[0][0] > have:
            self.lost += (batches[0][0] if batches else self.sent) - have
            at, renumbered = have, []
            for _, batch, news in batches:
                renumbered.append((at, batch, news))
                at += _rows(batch)
            self.unkept = deque(renumbered)
            batches = renumbered
        reply = Message("inserted", {"have": have})
        for first, batch, news in batches:
            reply = self._insert(first, batch, news)
            self.resent += 1
        return reply

    def _forget_kept(self, kept: int, capacity: int = 0) -> None:
        """Drop the batches a snapshot holds, and those older than the buffer's last ``capacity`` transitions of
        this process (its ring holds no more of them, so there is nothing to send again), when it says its
        capacity: what this process holds stays bounded however long the buffer goes without a snapshot."""
        while self.unkept and self.unkept[0][0] + _rows(self.unkept[0][1]) <= kept:
            self.unkept.popleft()
        while capacity and self.unkept and self.unkept[0][0] + _rows(self.unkept[0][1]) <= self.sent - capacity:
            self.unkept.popleft()

    def sample(self, count: int, target: float | None = None, updated: dict[str, torch.Tensor] | None = None
               ) -> Message | None:
        """A batch (tensors, with ``_slots``, ``_written`` and ``_weights``); None while the buffer is empty or the
        throttle holds this side back. ``target``: paced to that many samples per insert (the batch's size varies
        around ``count``). ``updated``: new priorities of an earlier batch (``slots``, ``written``, ``priorities``),
        applied before this one is drawn: one round trip a learner step instead of two."""
        ring = self._ring_now()
        meta = {"count": count, **({"target": target} if target else {}),
                **({"direct": ring.token.hex()} if ring is not None else {})}
        reply = self.call(Message("sample", meta, _priority_tensors(**updated) if updated else {}))
        if reply.op != "sampled":
            return None
        if not reply.meta.get("direct"):
            if ring is not None:  # a restarted service with a ring of its own: look for it at the next sample
                self._drop_ring("the service's ring changed")
            return reply
        assert ring is not None
        slots, written, weights = reply.tensors["_slots"], reply.tensors["_written"], reply.tensors["_weights"]
        got = ring.gather(slots, written)
        batch, kept = got.batch, got.kept
        if not bool(kept.all()):
            self.torn += int((~kept).sum())
            batch = {name: t[kept] for name, t in batch.items()}
            slots, written, weights = slots[kept], written[kept], weights[kept]
        return Message("sampled", reply.meta, {**batch, "_slots": slots, "_written": written, "_weights": weights})

    def _ring_now(self) -> SharedRing | None:
        """The service's shared ring, mapped here once per connection when this host has it; None otherwise."""
        if not self.direct or self.ring is not None:
            return self.ring
        if self.conn is not None and self._ring_looked == self.reconnects:
            return None
        where = self.call(Message("ring", {})).meta
        self._ring_looked = self.reconnects
        if not where.get("path"):
            self.ring_why = "the service keeps no shared ring"
            return None
        try:
            self.ring = SharedRing.open(str(where["path"]), bytes.fromhex(str(where["token"])))
        except ConfigError as exc:  # another host's service, most often
            self.ring_why = str(exc)
        return self.ring

    def _drop_ring(self, why: str) -> None:
        if self.ring is not None:
            self.ring.close()
        self.ring, self.ring_why, self._ring_looked = None, why, -1

    def priorities(self, slots: torch.Tensor, written: torch.Tensor, priorities: torch.Tensor) -> int:
        reply = self.call(Message("priorities", {}, _priority_tensors(slots, written, priorities)))
        return int(reply.meta["applied"])

    def put_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.call(Message("weights_put", {"version": version}, tensors))

    def get_weights(self, have: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest weights if newer than version ``have``."""
        reply = self.call(Message("weights_get", {"have": have}))
        return (int(reply.meta["version"]), reply.tensors) if reply.op == "weights" else None

    def put_deal(self, dealt: dict[int, tuple[int, ...]]) -> None:
        self.call(Message("deal_put", {"dealt": {str(rank): list(owned) for rank, owned in dealt.items()}}))

    def get_slices(self) -> tuple[int, list[int]]:
        reply = self.call(Message("deal_get", {}))
        return int(reply.meta["version"]), [int(s) for s in reply.meta["slices"]]

    def stats(self) -> dict[str, object]:
        return dict(self.call(Message("stats", {})).meta)

    def route(self) -> str:
        """How this process's tensors reach the service (connecting first if it has not yet)."""
        if self.conn is None:
            self.stats()
        conn = self.conn
        if conn is not None and conn.lane is not None:
            return f"through shared memory (a lane of {conn.lane.size >> 10} KiB)"
        return f"on the socket ({conn.lane_why if conn is not None and conn.lane_why else 'no lane asked for'})"

    def sample_route(self) -> str:
        """Where this process's samples come from (looking for the shared ring first if it has not yet)."""
        ring = self._ring_now()
        if ring is not None:
            return f"gathered here from the shared ring {ring.path.name}"
        return f"{self.route()} ({self.ring_why or 'not gathered from a shared ring'})"

    def snapshot(self) -> int:
        """Ask the buffer for a snapshot now; the transitions it holds in all."""
        reply = self.call(Message("snapshot", {}))
        self._forget_kept(int(reply.meta.get("kept", 0)))
        return int(reply.meta["inserted"])

    def settle(self) -> int:
        """Before this process leaves: a snapshot of the buffer now, so that what it sent outlives both it and a
        restart of the buffer; the transitions still held only here (0 once the snapshot has them all)."""
        self.snapshot()
        return sum(_rows(batch) for _, batch, _ in self.unkept)

    def shutdown(self) -> None:
        try:
            self.call(Message("shutdown", {}))
        except (ConfigError, TransportError):
            pass  # already gone
        self.close()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.ring is not None:
            self._drop_ring("closed")


def _priority_tensors(slots: torch.Tensor, written: torch.Tensor, priorities: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"slots": slots, "written": written, "priorities": priorities.float()}


def _rows(batch: dict[str, torch.Tensor]) -> int:
    return int(next(iter(batch.values())).shape[0])
