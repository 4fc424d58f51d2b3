"""The agent's heartbeat: a long poll of the master that renews the workers' lease and carries what the master
pushes (the round's and job's changes, role orders, role addresses, the training config's versions)."""

from __future__ import annotations

import queue
import threading
import time

from convoy import log
from convoy.agent.agent_config import AgentConfig
from convoy.control.protocol import messages as p
from convoy.control.protocol.client import MasterClient
from convoy.errors import ConvoyError
from convoy.procs import Wakeup
from convoy.worker.lease import LeaseWriter
from convoy.worker.live_config import config_file, write_config
from convoy.worker.role_env import addresses_file, write_addresses


class Heartbeat(threading.Thread):
    """Long-polls the master; ``changed`` is set whenever the round or job status moves."""

    def __init__(self, config: AgentConfig) -> None:
        super().__init__(name="convoy-heartbeat", daemon=True)
        self.config = config
        self.client = MasterClient(config.master_host, config.master_port, config.token, config.master_timeout_s,
                                   config.tls_ca)
        self.latest: p.HeartbeatResponse | None = None
        self.error: ConvoyError | None = None
        self.changed = Wakeup()
        """The agent's main thread waits on it (a stop signal may raise there: ``procs.Wakeup``)."""
        self.stopping = threading.Event()
        self.lease: LeaseWriter | None = None
        self.running: p.RoundInfo | None = None
        """The round this node's workers run in; each heartbeat of it renews their lease."""
        self.across_rounds = False
        """A job of roles: its processes live across the job's rounds, so each heartbeat renews their lease for
        the round it names (the lease ends with the job, not with a round)."""
        self.orders: queue.SimpleQueue[tuple[list[p.RoleAssignment], list[p.RoleStop]]] = queue.SimpleQueue()
        """What the master's replies asked of a job of roles, for the main loop to carry out."""
        self.addresses_version = 0
        """The role addresses' version written to this node's addresses file (role_env.ADDRESSES_FILE_ENV)."""
        self.addresses: dict[str, list[str]] = {}
        self.incarnations: dict[str, list[int]] = {}
        """What that file holds (the master may send only what changed since)."""
        self.restart_coming = threading.Event()
        """Set when a pushed config version applies by a restart: the agent warms the next round's workers now."""
        self.config_version = 0
        """The training config's version written to this node's config file (``live_config.config_file``)."""
        self.poll_s = 0.0
        """The poll the master asked for in its last reply (0: none yet, the agent's own ``heartbeat_s``); longer in a
        large job, to bound the master's load, and spread at random."""

    def heard_end(self) -> bool:
        """Whether the master has said that the job ended (it exits once every agent has heard, or a bound passed)."""
        latest = self.latest
        return latest is not None and latest.job_status != "running"

    def run(self) -> None:
        while not self.stopping.is_set():
            known_round = self.latest.round_id if self.latest else 0
            request = p.HeartbeatRequest(node_id=self.config.node_id, round_id=known_round,
                                         wait_s=self.poll_s or self.config.heartbeat_s,
                                         addresses_version=self.addresses_version, config_version=self.config_version)
            sent_at = time.monotonic()
            try:
                reply = self.client.call("/heartbeat", request, p.HeartbeatResponse, wait_s=request.wait_s)
            except ConvoyError as exc:
                self.error = exc
                self.changed.set()
                return
            self._renew(reply, sent_at)
            self.poll_s = reply.poll_s
            news = reply.addresses_version > self.addresses_version or reply.train_config is not None
            self._publish_addresses(reply)
            self._publish_config(reply)
            if reply.assignments or reply.stops:
                self.orders.put((reply.assignments, reply.stops))
                self.changed.set()
                news = True
            known = (self.latest.round_id, self.latest.job_status) if self.latest else None
            if known != (reply.round_id, reply.job_status):
                self.latest = reply
                self.changed.set()
                news = True
            if reply.job_status != "running":
                return
            if not news:  # a master that answered early (one that does not park polls): the rest is waited out here
                self.stopping.wait(request.wait_s - (time.monotonic() - sent_at))

    def _publish_addresses(self, reply: p.HeartbeatResponse) -> None:
        """Give this node's role processes the master's newer addresses (a moved process is found there)."""
        if reply.addresses_version <= self.addresses_version:
            return
        addresses, incarnations, changes = reply.addresses, reply.incarnations, reply.address_changes
        if changes is not None:
            if changes.since != self.addresses_version:  # not from what this node holds: the next reply sends all
                log.warning(f"convoy agent {self.config.node_id}: role address changes since version {changes.since} "
                            f"do not apply to version {self.addresses_version}; asking for all of them")
                self.addresses_version = 0
                return
            addresses, incarnations = changes.applied_to(self.addresses, self.incarnations)
        path = addresses_file(self.config.run_dir, self.config.node_id)
        try:
            write_addresses(path, reply.addresses_version, addresses, incarnations)
        except OSError as exc:  # the processes keep the addresses they have; the next reply tries again
            log.warning(f"convoy agent {self.config.node_id}: cannot write the role addresses to {path}: {exc}")
            return
        self.addresses_version, self.addresses, self.incarnations = reply.addresses_version, addresses, incarnations

    def _publish_config(self, reply: p.HeartbeatResponse) -> None:
        """Give this node's processes the training config's newer versions (they read the file at each step)."""
        state = reply.train_config
        if state is None or state.version <= self.config_version:
            return
        path = config_file(self.config.run_dir, self.config.node_id)
        try:
            write_config(path, state)
        except OSError as exc:  # the processes keep the versions they have; the next reply tries again
            log.warning(f"convoy agent {self.config.node_id}: cannot write the training config to {path}: {exc}")
            return
        self.config_version = state.version
        if any(v.apply == "restart" and v.status == "pending" for v in state.versions):
            self.restart_coming.set()
            self.changed.set()

    def _renew(self, reply: p.HeartbeatResponse, sent_at: float) -> None:
        """The master heard this node at ``sent_at``: its workers may write state that much longer,
        unless the round they run in is over."""
        running, lease = self.running, self.lease
        if lease is None or running is None:
            return
        if reply.job_status == "running" and (reply.round_id == running.round_id or self.across_rounds):
            lease.grant(reply.round_id, sent_at, running.lease_s)
        else:
            lease.revoke()
