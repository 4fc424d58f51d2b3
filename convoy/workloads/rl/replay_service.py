"""The replay role's service: the buffer, the newest policy weights and the slices' deal behind one authenticated
listener (the role services' transport), a table of handlers, and a ticker that measures rates and snapshots.

Ops (``Message.op``): ``insert`` (an actor's transitions, exactly once: each batch says how many of its own came
before it), ``sample`` (with ``direct``: only the slots, for a learner that gathers them from the shared ring),
``ring`` (where the shared ring is), ``priorities``, ``stats``, ``weights_put`` / ``weights_get`` (by version),
``deal_put`` / ``deal_get`` (an actor's slices), ``snapshot`` and ``shutdown``. A malformed insert is refused whole and counted;
in throttle mode an insert or a sample waits (Reverb's rate limiter, ``rates.Throttle``) and the time waited is
counted per side. In scale mode nobody waits: each paced sample gets what the learners owe at the target, and
inserts enter the table as the samples allow, the rest staged in order (``staging.py``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from convoy.errors import ConfigError
from convoy.parallel.transport import Credentials, Identity, Limits, Listener, Message
from convoy.parallel.transport.handshake import Admit
from convoy.runtime.slots import SnapshotNoSpace
from convoy.workloads.rl.buffer import BadTransitions, ReplayBuffer
from convoy.workloads.rl.rates import Pacer, RateMeter, Throttle
from convoy.workloads.rl.replay_snapshots import BufferSnapshots
from convoy.workloads.rl.ring import SharedRing
from convoy.workloads.rl.staging import Staging

TICK_S = 0.25
THROTTLE_WAIT_S = 30.0
"""Longest a throttled call waits before it is answered ``wait`` (the caller asks again)."""
RETURNS_KEPT = 100


@dataclass
class Waited:
    """Seconds the throttle held each side."""

    insert_s: float = 0.0
    sample_s: float = 0.0


@dataclass
class Episodes:
    """The actors' finished episodes: the last returns, and environment steps in all."""

    returns: deque[float] = field(default_factory=lambda: deque(maxlen=RETURNS_KEPT))
    finished: int = 0
    env_steps: int = 0

    def saved(self) -> dict[str, Any]:
        return {"returns": list(self.returns), "finished": self.finished, "env_steps": self.env_steps}

    @staticmethod
    def from_saved(saved: dict[str, Any]) -> Episodes:
        return Episodes(deque((float(r) for r in saved.get("returns", [])), maxlen=RETURNS_KEPT),
                        int(saved.get("finished", 0)), int(saved.get("env_steps", 0)))

    def add(self, reported: list[Any], steps: int) -> None:
        for entry in reported:
            self.returns.append(float(entry))
            self.finished += 1
        self.env_steps += steps

    @property
    def mean_return(self) -> float | None:
        return sum(self.returns) / len(self.returns) if self.returns else None


class ReplayService:
    """Serves ``buffer`` on ``host:port``; ``snapshots`` (optional) every ``snapshot_every_s``; ``throttle`` makes
    the faster side wait (None: nobody waits, the controller scales instead)."""

    def __init__(self, buffer: ReplayBuffer, host: str = "127.0.0.1", port: int = 0, *,
                 snapshots: BufferSnapshots | None = None, snapshot_every_s: float = 5.0,
                 throttle: Throttle | None = None, credentials: Credentials | None = None,
                 admit: Admit | None = None, limits: Limits | None = None, window_s: float = 2.0,
                 kept: Mapping[str, Any] | None = None, say: Callable[[str], None] = print,
                 stage_rows: int | None = None, ring: SharedRing | None = None) -> None:
        """``kept``: what a snapshot held beside the buffer (``BufferSnapshots.restore``'s second part);
        ``stage_rows``: a fixed size for the scale mode's staging (None: sized to the table's intake); ``ring``: the
        buffer's columns in shared memory, which learners on this host gather from."""
        self.buffer, self.snapshots, self.throttle, self.say = buffer, snapshots, throttle, say
        self.ring = ring
        if ring is not None:
            buffer.share(ring.columns, ring.written)
        self.snapshot_failures = 0
        """Snapshots that found no room (a full /dev/shm): the service serves on and tries again each interval."""
        self._snapshots_back = False
        self.snapshot_every_s = snapshot_every_s
        self.changed = threading.Condition()
        self.meter = RateMeter(window_s)
        self.waited = Waited()
        self.episodes = Episodes()
        self.weights: tuple[int, dict[str, torch.Tensor]] = (0, {})
        self.deal: tuple[int, dict[int, list[int]]] = (0, {})
        self.duplicates = 0
        """Transitions an actor sent again that the buffer already held (skipped)."""
        self.visits: dict[int, int] = {}
        """Episodes started in each slice, as the actors report them."""
        self.demanded = 0
        """Transitions the learners asked for (their nominal batches): the demand the controller scales by."""
        self.waiting = 0
        """Calls the throttle holds now."""
        self.pacer = Pacer()
        self.paced: tuple[float, int] | None = None
        """(target, nominal batch) of the learners' paced samples: from the first one, inserts go through staging."""
        self.staging = Staging(stage_rows or max(1, buffer.capacity // 4)) if throttle is None else None
        self.stage_sized = stage_rows is None
        """Scale mode's inserts that the samples do not allow yet (sized to some seconds of the table's intake)."""
        self.received: dict[str, int] = dict(buffer.counters.by_source)
        """Each source's transitions taken in (in the table or staged): what its next batch's ``first`` must be."""
        self.received_total = buffer.counters.inserted
        if kept:
            self.episodes = Episodes.from_saved(dict(kept.get("episodes", {})))
            self.duplicates = int(kept.get("duplicates", 0))
            self.visits = {int(k): int(v) for k, v in dict(kept.get("visits", {})).items()}
        self.stopped = threading.Event()
        self.ops: dict[str, Callable[[Message, Identity | None], Message]] = {
            "insert": self._insert, "sample": self._sample, "priorities": self._priorities, "stats": self._stats,
            "weights_put": self._weights_put, "weights_get": self._weights_get, "deal_put": self._deal_put,
            "deal_get": self._deal_get, "snapshot": self._snapshot, "shutdown": self._shutdown, "ring": self._ring}
        self.listener = Listener(self.handle, host, port, replied=self._replied, credentials=credentials,
                                 admit=admit, limits=limits)
        self.address = self.listener.address
        self._ticker = threading.Thread(target=self._tick, name="replay-ticker", daemon=True)
        self._ticker.start()

    def handle(self, message: Message, caller: Identity | None = None) -> Message:
        op = self.ops.get(message.op)
        if op is None:
            raise ConfigError(f"unknown replay op {message.op!r}; one of {sorted(self.ops)}")
        try:
            return op(message, caller)
        except BadTransitions as exc:  # the caller gets it as the ConfigError it is
            raise ConfigError(f"malformed transitions refused: {exc}") from exc

    def wait(self, timeout: float | None = None) -> bool:
        done = self.stopped.wait(timeout)
        if done:
            self.listener.close()
        return done

    def close(self) -> None:
        self.stopped.set()
        self.listener.close()
        if self.snapshots is not None:
            self.snapshots.close()
        if self.ring is not None:  # a learner that still maps it keeps its pages until it lets go
            self.ring.path.unlink(missing_ok=True)

    def _replied(self, reply: Message) -> None:
        if reply.op == "bye":
            self.stopped.set()

    @staticmethod
    def _source(message: Message, caller: Identity | None) -> str:
        if caller is not None:
            return f"{caller.role}{caller.rank}.{caller.incarnation}"
        return str(message.meta.get("source", ""))

    def _held_until(self, allowed: Callable[[], bool]) -> tuple[bool, float]:
        """Wait (holding ``changed``) until ``allowed``; (whether it is, seconds waited)."""
        if allowed():
            return True, 0.0
        began = time.monotonic()
        self.waiting += 1
        try:
            ok = self.changed.wait_for(lambda: allowed() or self.stopped.is_set(), THROTTLE_WAIT_S)
        finally:
            self.waiting -= 1
        return ok and not self.stopped.is_set(), time.monotonic() - began

    def _insert(self, message: Message, caller: Identity | None) -> Message:
        source = self._source(message, caller)
        first = int(message.meta.get("first", -1))  # this source's transitions before the batch (-1: uncounted)
        with self.changed:
            counters = self.buffer.counters
            try:
                rows = self.buffer.layout.rows_of(message.tensors)
            except BadTransitions:
                counters.refused += 1
                raise
            have = self.received.get(source, 0)
            if first > have:  # a gap: the buffer came back from a snapshot older than what the actor saw kept
                return Message("resend", {"from": have})
            skip = min(rows, have - first) if first >= 0 else 0
            if self.throttle is not None:
                throttle = self.throttle
                throttle.check(rows - skip, inserting=True, inserted=counters.inserted)
                ok, waited = self._held_until(lambda: throttle.may_insert(counters.inserted, counters.sampled,
                                                                          rows - skip))
            elif self.staging is not None and self.paced is not None:  # scaling and staging are both spent
                staging = self.staging
                ok, waited = self._held_until(lambda: staging.fits(rows - skip))
            else:
                ok, waited = True, 0.0
            self.waited.insert_s += waited
            if not ok:
                return Message("wait", {"waited_s": waited})
            if waited:  # while it waited, the same batch may have come again (a resend after a time-out)
                have = self.received.get(source, 0)
                if first > have:
                    return Message("resend", {"from": have})
                skip = min(rows, have - first) if first >= 0 else 0
            fresh, taken = {name: t[skip:] for name, t in message.tensors.items()}, rows - skip
            if self.paced is None or self.staging is None:
                self.buffer.insert(fresh, source, rows=taken)
            else:
                self.staging.push(source, fresh, taken)
                self._admit()
            self.received[source] = have + taken
            self.received_total += taken
            self.duplicates += skip
            if skip == 0:  # a batch sent again had its episodes counted when it first came
                self.episodes.add(list(message.meta.get("returns", [])), int(message.meta.get("env_steps", 0)))
                for index, count in dict(message.meta.get("visits", {})).items():
                    self.visits[int(index)] = self.visits.get(int(index), 0) + int(count)
            self.changed.notify_all()
            kept = self.snapshots.kept.get(source, 0) if self.snapshots is not None else have + taken
            return Message("inserted", {"have": have + taken, "kept": kept, "capacity": self.buffer.capacity,
                                        "size": self.buffer.size,
                                        "env_steps": self.episodes.env_steps})

    def _sample(self, message: Message, caller: Identity | None) -> Message:
        """``count`` transitions; with ``target`` (paced), as many as the learners owe at that many samples per
        insert, within the pacer's bounds around ``count`` (nobody waits). New priorities of an earlier batch, when
        the message carries them, are applied first."""
        count = int(message.meta.get("count", 0))
        target = message.meta.get("target")
        if message.tensors:
            self._priorities(message, caller)
        with self.changed:
            self.demanded += count
            if self.throttle is not None:
                throttle, counters = self.throttle, self.buffer.counters
                throttle.check(count, inserting=False, inserted=counters.inserted)
                ok, waited = self._held_until(lambda: throttle.may_sample(counters.inserted, counters.sampled, count))
                self.waited.sample_s += waited
                if not ok:
                    return Message("wait", {"waited_s": waited})
            if self.buffer.size == 0:
                return Message("wait", {"waited_s": 0.0})
            if target is not None and self.throttle is None:
                self.paced = (float(target), count)
                # owed by the table's count, not the staged rows: with rows staged the table takes in what the
                # learners sample, so they sample their own batch (a staged backlog is no debt to catch up on larger
                # batches: fewer, larger updates learn less from each environment step)
                count = self.pacer.count(float(target), count, self.buffer.counters.inserted,
                                         self.buffer.counters.sampled)
            direct = self.ring is not None and message.meta.get("direct") == self.ring.token.hex()
            drawn = self.buffer.sample(count, gather=not direct)
            self._admit()
            self.changed.notify_all()
        tensors = {**({} if direct else drawn.batch), "_slots": drawn.slots, "_written": drawn.written,
                   "_weights": drawn.weights}
        return Message("sampled", {"size": self.buffer.size, "env_steps": self.episodes.env_steps,
                                   "mean_return": self.episodes.mean_return, "direct": direct}, tensors)

    def _ring(self, message: Message, caller: Identity | None) -> Message:
        """Where the shared ring is, and the token that proves a mapping of it is this service's ('' : none)."""
        if self.ring is None:
            return Message("ring", {"path": "", "token": ""})
        return Message("ring", {"path": str(self.ring.path), "token": self.ring.token.hex()})

    def _admit(self) -> None:
        """Move what the samples now allow from staging into the table (the caller holds ``changed``)."""
        if self.staging is None or self.paced is None or not self.staging.rows:
            return
        target, nominal = self.paced
        counters, (inserted_at, sampled_at) = self.buffer.counters, self.pacer.base or (0, 0)
        due = self.staging.due(counters.inserted - inserted_at, counters.sampled - sampled_at, target, nominal)
        for source, batch, rows in self.staging.take(due):  # counted from where pacing began, as the pacer counts
            self.buffer.insert(batch, source, rows=rows)

    def _priorities(self, message: Message, caller: Identity | None) -> Message:
        tensors = message.tensors
        try:
            slots, written, priorities = tensors["slots"], tensors["written"], tensors["priorities"]
        except KeyError as exc:
            raise BadTransitions(f"priorities need the tensors slots, written and priorities; missing {exc}") from exc
        with self.changed:
            applied = self.buffer.update_priorities(slots, written, priorities)
        return Message("updated", {"applied": applied})

    def stats(self) -> dict[str, Any]:
        with self.changed:
            inserts, samples, demanded = self.meter.rates(3)
            counters = self.buffer.counters
            return {"inserts_per_s": inserts, "samples_per_s": samples, "demanded_per_s": demanded,
                    "inserted": counters.inserted, "received": self.received_total,
                    "staged": self.staging.rows if self.staging is not None else 0,
                    "staging_limit": self.staging.limit if self.staging is not None else 0,
                    "sampled": counters.sampled, "refused": counters.refused, "size": self.buffer.size,
                    "capacity": self.buffer.capacity, "stale_priorities": counters.stale_priorities,
                    "duplicates": self.duplicates, "waited_insert_s": self.waited.insert_s, "waiting": self.waiting,
                    "waited_sample_s": self.waited.sample_s, "episodes": self.episodes.finished,
                    "env_steps": self.episodes.env_steps, "mean_return": self.episodes.mean_return,
                    "returns_kept": len(self.episodes.returns), "weights_version": self.weights[0],
                    "snapshots": self.snapshots.taken if self.snapshots is not None else 0,
                    "snapshot_failures": self.snapshot_failures,
                    "by_source": dict(counters.by_source), "visits": {str(k): v for k, v in self.visits.items()}}

    def _stats(self, message: Message, caller: Identity | None) -> Message:
        return Message("stats", self.stats())

    def _weights_put(self, message: Message, caller: Identity | None) -> Message:
        if caller is not None and caller.role != "learner":
            raise ConfigError(f"{caller.describe()} may not put weights: only the learners train them")
        version = int(message.meta.get("version", 0))
        with self.changed:
            if version > self.weights[0]:
                self.weights = (version, {name: t.clone() for name, t in message.tensors.items()})
            return Message("stored", {"version": self.weights[0]})

    def _weights_get(self, message: Message, caller: Identity | None) -> Message:
        have = int(message.meta.get("have", 0))
        with self.changed:
            version, tensors = self.weights
        if version <= have:
            return Message("same", {"version": version})
        return Message("weights", {"version": version}, tensors)

    def _deal_put(self, message: Message, caller: Identity | None) -> Message:
        dealt = {int(rank): [int(s) for s in owned] for rank, owned in dict(message.meta.get("dealt", {})).items()}
        with self.changed:
            if dealt != self.deal[1]:
                self.deal = (self.deal[0] + 1, dealt)
            return Message("dealt", {"version": self.deal[0]})

    def _deal_get(self, message: Message, caller: Identity | None) -> Message:
        rank = caller.rank if caller is not None else int(message.meta.get("rank", 0))
        with self.changed:
            version, dealt = self.deal
        return Message("slices", {"version": version, "slices": dealt.get(rank, [])})

    def take_snapshot(self) -> int:
        """A snapshot now; the transitions inserted in all. With no room for it (a full /dev/shm) the service says so
        once, serves on without one (the actors keep what they sent until a snapshot holds it: nothing is lost
        that they still hold) and tries again at the next one; it says when snapshots are back."""
        if self.snapshots is None:
            raise ConfigError("this replay service keeps no snapshots")
        with self.changed:
            try:
                self.snapshots.take(self.buffer, {"episodes": self.episodes.saved(), "duplicates": self.duplicates,
                                                  "visits": dict(self.visits)})
            except SnapshotNoSpace as exc:
                self.snapshot_failures += 1
                if self.snapshot_failures == 1 or self._snapshots_back:
                    self.say(f"replay: no room for its snapshot ({exc}); serving on without one: the actors keep "
                             f"what they sent until a snapshot holds it, and it tries again every "
                             f"{self.snapshot_every_s:g} s")
                self._snapshots_back = False
                return self.buffer.counters.inserted
            if self.snapshot_failures and not self._snapshots_back:
                self.say(f"replay: snapshots taken again after {self.snapshot_failures} without room")
                self._snapshots_back = True
            return self.buffer.counters.inserted

    def _snapshot(self, message: Message, caller: Identity | None) -> Message:
        """A snapshot now; the reply says how many of the caller's transitions it keeps."""
        inserted = self.take_snapshot()
        kept = self.snapshots.kept.get(self._source(message, caller), 0) if self.snapshots is not None else 0
        return Message("snapshotted", {"inserted": inserted, "kept": kept})

    def _shutdown(self, message: Message, caller: Identity | None) -> Message:
        return Message("bye", {})

    def _tick(self) -> None:
        last_snapshot = time.monotonic()
        while not self.stopped.wait(TICK_S):
            now = time.monotonic()
            with self.changed:
                self.meter.note(now, self.received_total, self.buffer.counters.sampled, self.demanded)
                if self.staging is not None and self.paced is not None and self.stage_sized:
                    self.staging.size_for(now, self.meter.rates(3)[1] / self.paced[0], self.buffer.capacity)
                    self.changed.notify_all()
            if self.snapshots is not None and now - last_snapshot >= self.snapshot_every_s and self.buffer.size:
                self.take_snapshot()
                last_snapshot = now
