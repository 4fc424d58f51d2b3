"""The nodes' two long polls, ``/wait`` (until the round a node waits for has closed) and ``/heartbeat`` (the node's
lease; until the round, the job or what is pushed to the node changes). Each answers at once when there is news,
else returns a ``LongPoll`` the API parks without a thread.

At N nodes the master hears N heartbeats per poll: it asks for a poll of ``poll_for(N)`` seconds so that it hears
about ``BEATS_PER_S`` a second, and a round's membership (the same for every node) is encoded once."""

from __future__ import annotations

import math
import random
import threading
import time
from typing import Any

from convoy.control.core import MasterCore
from convoy.control.long_polls import LongPoll
from convoy.control.protocol import messages as p
from convoy.control.rendezvous import Membership
from convoy.control.replies import Encoded, Joined, encoded_once
from convoy.control.roles.address_book import AddressBook, Wave, wave_for

BEATS_PER_S = 250.0
"""The heartbeats a second the master's poll length aims at (about a tenth of its two cores at ~0.5 ms each)."""
LEASE_SHARE = 3.0
"""A poll is at most this fraction of the heartbeat time-out: a lost reply still leaves two more before it."""
MAX_POLL_S = 60.0
"""The protocol's bound on a poll."""
POLL_SPREAD, NEWS_SPREAD = 0.1, 0.9
"""Each reply asks for a poll up to this much shorter, at random; a reply with news (a round change answers every
node at once) up to ``NEWS_SPREAD`` shorter, so that the nodes come due apart from then on rather than together
at every poll (1024 heartbeats in one burst each poll: a p99 of 420 ms)."""


MASTER_GC_THRESHOLDS = (10_000, 20, 1_000)
"""The master process's garbage collector. Its parked polls live a poll long (seconds), so they reach the oldest
generation, and each of Python's full collections then swept every object of thousands of parked polls: at 4096
nodes 15 full collections in three minutes, up to 200 ms each, with the master stopped (a heartbeat p99 of 200 ms).
With these a full collection comes after a thousand of the middle generation's; the young ones stay a few ms."""


def poll_for(nodes: int, heartbeat_s: float, heartbeat_timeout_s: float) -> float:
    """The heartbeat poll the master asks of each node: its configured one, longer where N nodes would beat
    faster than ``BEATS_PER_S``, and within the lease."""
    return min(max(heartbeat_s, nodes / BEATS_PER_S), heartbeat_timeout_s / LEASE_SHARE, MAX_POLL_S)


class NodePolls:
    """``/wait`` and ``/heartbeat`` of one master; ``role_master`` and ``train_calls`` are its parts (the roles'
    orders and addresses, the training config's versions), ``stopping`` is set when it stops."""

    def __init__(self, core: MasterCore, role_master: Any, train_calls: Any, stopping: threading.Event) -> None:
        self.core, self.role_master, self.train_calls, self.stopping = core, role_master, train_calls, stopping
        self.acknowledged: set[str] = set()
        """Nodes told that the job ended."""
        self._ready: tuple[tuple[Any, ...], Encoded] | None = None
        """The last ready answer to ``/wait`` and what it was made of."""
        self.book = AddressBook()
        """A job of roles: the addresses as the nodes are told them, in waves."""
        self._roles_moved = True
        """Whether the roles may have changed since the last wave (every change the master applies sets it)."""

    def epoch(self) -> object:
        """What parked polls wait on; while it is the same, none of them has news (read under the lock). A job of
        roles adds the addresses' wave and the count of orders queued for the nodes."""
        job = self.core.job
        epoch = (job.round_id, job.status, self.stopping.is_set(), id(job.membership), job.rendezvous.dropped,
                 self.train_calls.config_version)
        if self.role_master is not None:
            return epoch + (self._wave().version, self.role_master.orders.news)
        return epoch

    def applied(self) -> None:
        """The master applied a change (its lock held): the roles are looked at again for the next wave."""
        self._roles_moved = True

    def tick(self, now: float) -> None:
        """The master's tick (its lock held): a wave, or an order not reported on, that has come due again wakes
        the parked polls' watcher."""
        if self.role_master is None:
            return
        if self.role_master.orders.come_due(now) or (self._roles_moved and self.book.due(now, self._wave_s())):
            self.core.changed.notify_all()

    def _wave_s(self) -> float:
        return wave_for(len(self.core.nodes.nodes))

    def _wave(self) -> Wave:
        """The roles' addresses as the nodes are told them now (lock held): a new wave where one is due."""
        now = time.monotonic()
        if self._roles_moved and self.book.due(now, self._wave_s()):
            self._roles_moved = False
            self.book.publish(Wave(*self.role_master.published()), now)
        return self.book.wave

    def wait(self, req: p.WaitRequest) -> p.WaitResponse | Encoded | LongPoll:
        """Long poll until the round the node waits for has closed (or moved on)."""
        with self.core.changed:
            self._confirm(req.node_id, req.round_id)
            if req.timeout_s > 0 and self.wait_state(req) == "waiting":
                return LongPoll(lambda: self.wait_state(req) != "waiting", time.monotonic() + req.timeout_s,
                                lambda: self._wait_answer(req))
            return self._wait_answer(req)

    def heartbeat(self, req: p.HeartbeatRequest) -> p.HeartbeatResponse | LongPoll:
        """Long poll: answers at once when the round, the job's status or what is pushed to the node changes."""
        with self.core.changed:
            now = time.monotonic()
            self.core.nodes.seen(req.node_id, now)
            self._confirm(req.node_id, req.round_id)
            if req.wait_s > 0 and not self._news(req):
                roles = self.role_master
                return LongPoll(lambda: self._news(req), now + req.wait_s, lambda: self._heartbeat_answer(req),
                                priority=0, urgent=(lambda: roles.has_news(req.node_id)) if roles is not None else None)
            return self._heartbeat_answer(req)

    def _confirm(self, node_id: str, round_id: int) -> None:
        """A call of the node's agent about ``round_id`` (lock held): it is alive and knows of the round, so a
        node that offered a port for it is placed now (``Job.confirm``; the round's event saved where it closed)."""
        events = self.core.job.confirm(node_id, round_id, time.monotonic())
        if events:
            self.core.apply(events)

    def wait_state(self, req: p.WaitRequest) -> str:
        job = self.core.job
        if self.core.ended or self.stopping.is_set():
            return "ended"
        if job.round_id < req.round_id:
            return "waiting"
        membership = job.membership
        if job.round_id > req.round_id:
            return "rejoin"
        if membership is None:  # a restarted master has forgotten who had joined: they join again
            return "waiting" if job.rendezvous.is_waiting(req.node_id) else "rejoin"
        return "ready" if membership.member(req.node_id) else "rejoin"

    def round_info(self, membership: Membership) -> p.RoundInfo:
        self.train_calls.round_seen()  # a rollback's round restores at most its step from its first member on
        job, config = self.core.job, self.core.config
        members = [p.MemberInfo(**vars(m)) for m in membership.members]
        return p.RoundInfo(
            job_id=job.job_id, round_id=membership.round_id, members=members,
            world_size=membership.world_size, master_addr=membership.master_addr,
            master_port=membership.master_port, restart_count=job.restart_count,
            max_restarts=job.max_restarts, lease_s=config.heartbeat_timeout_s,
            roles=self.role_master is not None, restore_at_most=self.train_calls.train.restore_at_most(
                membership.round_id),
        )

    def note_outcome_heard(self, node_id: str) -> None:
        if self.core.ended:
            self.acknowledged.add(node_id)
            self.core.changed.notify_all()

    def _wait_answer(self, req: p.WaitRequest) -> p.WaitResponse | Encoded:
        with self.core.changed:
            job = self.core.job
            self.core.nodes.seen(req.node_id, time.monotonic())
            state = self.wait_state(req)
            self.note_outcome_heard(req.node_id)
            membership = job.membership
            if state != "ready" or membership is None:
                return p.WaitResponse(state=state, job_status=job.status)
            job.rendezvous.offer_next(req.node_id, membership.round_id, req.next_port)
            self.train_calls.round_seen()
            made_of = (membership, job.status, job.restart_count, job.max_restarts,
                       self.train_calls.train.restore_at_most(membership.round_id))
            if self._ready is None or self._ready[0] != made_of:
                reply = p.WaitResponse(state=state, job_status=job.status, round=self.round_info(membership))
                self._ready = (made_of, encoded_once(reply.model_dump_json().encode()))
            return self._ready[1]

    def _news(self, req: p.HeartbeatRequest) -> bool:
        job, roles = self.core.job, self.role_master
        return self.core.ended or job.round_id != req.round_id or self.stopping.is_set() \
            or (roles is not None and (roles.has_news(req.node_id) or self._wave().version > req.addresses_version)) \
            or self.train_calls.config_version > req.config_version

    def _heartbeat_answer(self, req: p.HeartbeatRequest) -> p.HeartbeatResponse | Encoded:
        """The node's lease renewed, and what is new for it; the roles' addresses (the bulk of a reply in a job of
        thousands of processes, the same for every node behind by the same waves) are encoded once per wave."""
        with self.core.changed:
            job, roles, config = self.core.job, self.role_master, self.core.config
            spread = NEWS_SPREAD if self._news(req) else POLL_SPREAD
            self.note_outcome_heard(req.node_id)
            assignments, stops = roles.deliver(req.node_id, time.monotonic()) if roles and not self.core.ended \
                else ([], [])
            if roles is not None and req.addresses_version > self.book.wave.version \
                    and roles.orders.outrank(req.addresses_version):
                # a restarted master saved an older version than the nodes hold: the next wave goes above theirs,
                # or they would keep the addresses they have (a moved process never found) until it did
                self._roles_moved, self.book.looked_at = True, -math.inf
            wave = self._wave() if roles else Wave()
            train = self.train_calls
            reply = p.HeartbeatResponse(
                job_status=job.status, round_id=job.round_id, message=job.outcome, assignments=assignments,
                stops=stops, addresses_version=wave.version,
                train_config=train.train.config_state() if train.config_version > req.config_version else None,
                poll_s=poll_for(len(self.core.nodes.nodes), config.heartbeat_s, config.heartbeat_timeout_s)
                * (1.0 - spread * random.random()))
            if wave.version <= req.addresses_version:
                return reply
            body = reply.model_dump_json(exclude={"addresses", "incarnations", "address_changes"}).encode()
            return Joined(body[:-1] + b",", self.book.tail(req.addresses_version))
