"""The job's life as a pure state machine: joins, failures, restarts, success.

Every call takes the current time and returns the events it caused; the master records
them and prints the ones marked for the console. No I/O happens here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from convoy.control.rendezvous import Membership, Rendezvous

if TYPE_CHECKING:
    from convoy.control.protocol.messages import WorkerExit

RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"
MAX_PORT_RETRIES = 3
"""Rounds reopened with a new port because MASTER_PORT was taken before rank 0 bound it; then it is a failure."""
PEER_LOSS_WAIT_S = 2.0
"""How long a failure that reads as a lost peer waits for news of a node's loss (which costs no restart) before it
is taken as a failure: a node's agent killed with its workers is heard of by its launcher (or its silence) a moment
after its peers on other nodes fail for want of them."""


@dataclass(frozen=True)
class Event:
    kind: str
    message: str
    node_id: str | None = None
    round_id: int | None = None
    console: bool = False


@dataclass
class Job:
    job_id: str
    rendezvous: Rendezvous
    max_restarts: int
    join_timeout_s: float
    status: str = RUNNING
    restart_count: int = 0
    regroup_count: int = 0
    """Rounds opened for membership changes (node lost or added); these are not restarts."""
    outcome: str = ""
    done_nodes: set[str] = field(default_factory=set)
    announced_round: int = 0
    max_regroups: int = 0
    """Regroups one node may cause (by being lost or by joining) per ``regroup_window_s``; 0: no limit."""
    regroup_window_s: float = 600.0
    regroups_by_node: dict[str, list[float]] = field(default_factory=dict)
    """When each node caused a regroup, within the last window."""
    excluded: dict[str, str] = field(default_factory=dict)
    """Nodes over their regroup budget -> why their joins are refused."""
    port_retries: int = 0
    """Rounds reopened because their MASTER_PORT was taken (not restarts)."""
    reconfigure_count: int = 0
    """Rounds opened to apply a restart field of the training config (not restarts)."""
    peer_loss_wait_s: float = PEER_LOSS_WAIT_S
    """How long a failure that reads as a lost peer is held for news of a lost node."""
    held_failure: tuple[WorkerExit, float] | None = None
    """A failure that reads as a lost peer, and when it came: it becomes a restart after PEER_LOSS_WAIT_S unless a
    node's loss (a regroup), or a failure of the workers' own, comes first."""

    @property
    def round_id(self) -> int:
        return self.rendezvous.round_id

    @property
    def membership(self) -> Membership | None:
        return self.rendezvous.membership

    def join(self, node_id: str, host: str, nproc: int, port: int, now: float,
             node_rank: int = -1, same_agent: bool = False) -> tuple[int, list[Event]]:
        """A node asks for a place (at ``node_rank``, if it asks for one); returns the round it waits for.

        ``same_agent``: the agent process that joined before asks again. A member of the running round then
        only repeats a join whose reply it never got (the master that closed the round was killed before it
        answered): it keeps its place. Another agent process of a member node is one that restarted: its
        workers are gone, and the job restarts."""
        events: list[Event] = []
        if self.status != RUNNING:
            return self.round_id, events
        if node_id in self.excluded:
            return self.round_id, [Event("join_refused", f"refused a join of excluded node {node_id}", node_id)]
        membership = self.membership
        grows = membership is not None and membership.member(node_id) is None and not self.rendezvous.is_open
        room = membership is not None and len(membership.members) < self.rendezvous.max_nodes
        if grows and room and self._over_budget(node_id, now, 1):
            return self.round_id, self._exclude(node_id, now, 1)
        if self.membership is not None and self.membership.member(node_id) is not None:
            if same_agent:
                return self.round_id, [Event("join_repeated", f"node {node_id} asked again to join round "
                                             f"{self.round_id}, of which it is a member: it keeps its place",
                                             node_id, self.round_id)]
            cause = f"node {node_id} rejoined while its round was running (a new agent process: its workers are gone)"
            events += [Event("agent_restarted", cause, node_id, self.round_id, True), *self._restart(cause, now)]
            if self.status != RUNNING:
                return self.round_id, events
        round_id = self.rendezvous.join(node_id, host, nproc, port, now, node_rank)
        events.append(Event("node_joined", f"node {node_id} ({host}, {nproc} workers) joined", node_id, round_id))
        membership = self.membership
        if membership is not None and round_id > self.round_id and len(membership.members) < self.rendezvous.max_nodes:
            grown = membership.node_ids() | {node_id}
            events += self._regroup(f"node {node_id} joins: growing to {len(grown)} nodes", now, grown, node_id)
            return self.round_id, events
        return round_id, events + self._closed_events()

    def confirm(self, node_id: str, round_id: int, now: float) -> list[Event]:
        """The agent of ``node_id`` asked about round ``round_id``: placed where it offered a port for it
        (``Rendezvous.confirm``); the round's event where that closed it."""
        if self.status != RUNNING or self.rendezvous.confirm(node_id, round_id, now) is None:
            return []
        return self._closed_events()

    def tick(self, now: float) -> list[Event]:
        """Advance timers: close a round whose window passed, fail a round that waits too long."""
        if self.status != RUNNING:
            return []
        self.rendezvous.tick(now)
        events = self._closed_events() + self._held_failure_due(now)
        short_since = self.rendezvous.short_of_min_since()
        if short_since is not None and now - short_since > self.join_timeout_s:
            have = len(self.rendezvous.joined)
            events += self._end(
                FAILED,
                f"round {self.round_id} waited {self.join_timeout_s:.0f} s with {have} of at least "
                f"{self.rendezvous.min_nodes} nodes; start more agents or lower --nnodes MIN",
            )
        return events

    def worker_exited(self, report: WorkerExit, now: float) -> list[Event]:
        """A worker of ``report.round_id`` failed: restart the job in a new round, or fail it."""
        if self.status != RUNNING or report.round_id != self.round_id or self.membership is None:
            return [Event("stale_report", f"ignored a failure report from round {report.round_id}",
                          report.node_id, report.round_id)]
        what = self._what(report)
        if report.infrastructure:  # one event names the fault; the rank's exit is recorded beside it
            return [Event("worker_failed", f"{what} in round {self.round_id}", report.node_id, self.round_id)] + \
                self._infrastructure_regroup(report.node_id, report.infrastructure, now)
        events = [Event("worker_failed", f"{what} in round {self.round_id}", report.node_id, self.round_id, True)]
        if report.start_failed:
            return events + self._end(FAILED, f"{what}; a worker that cannot start is not retried", report)
        if report.port_in_use and self.port_retries < MAX_PORT_RETRIES:
            return events + self._retry_port(now)
        if report.peer_lost:
            if self.held_failure is None:
                self.held_failure = (report, now)
            return events
        self.held_failure = None
        return events + self._failed(what, report, now)

    def _held_failure_due(self, now: float) -> list[Event]:
        """A failure held for news of a lost node, once no such news came in time: a restart, as any failure."""
        held = self.held_failure
        if held is None or now - held[1] < self.peer_loss_wait_s:
            return []
        self.held_failure = None
        report = held[0]
        if report.round_id != self.round_id or self.membership is None:
            return []  # a regroup (or another restart) came first: the failure belonged to that change
        return self._failed(self._what(report), report, now)

    def _what(self, report: WorkerExit) -> str:
        """The failed worker and how it ended, as the console names it."""
        member = self.membership.member(report.node_id) if self.membership is not None else None
        where = f"node {member.node_rank}" if member else f"node {report.node_id}"
        return f"rank {report.rank} ({where}, local rank {report.local_rank}) {report.describe()}"

    def _failed(self, what: str, report: WorkerExit, now: float) -> list[Event]:
        """A worker's failure: a restart, or the job's end once no restart is left."""
        if self.restart_count >= self.max_restarts:
            used = f"no restarts left ({self.restart_count} of {self.max_restarts} used)"
            return self._end(FAILED, f"{what}; {used}", report)
        return self._restart(what, now)

    def node_done(self, node_id: str, round_id: int) -> list[Event]:
        """All workers of a node exited 0; the job succeeds when every member's have."""
        if self.status != RUNNING or round_id != self.round_id or self.membership is None:
            return []
        self.done_nodes.add(node_id)
        if self.done_nodes >= self.membership.node_ids():
            return self._end(SUCCEEDED, f"all {self.membership.world_size} workers finished")
        return []

    def node_lost(self, node_id: str, why: str, now: float) -> list[Event]:
        """A node's agent is gone: restart without it if it was a member, else forget it."""
        if self.status != RUNNING:
            return []
        if self.membership is not None and self.membership.member(node_id) is not None:
            survivors = self.membership.node_ids() - {node_id}
            events = self._regroup(f"node {node_id} {why}: going on with {len(survivors)} nodes", now, survivors,
                                   node_id)
            if self._over_budget(node_id, now, 0):
                events += self._exclude(node_id, now, 0)
                if len(survivors) < self.rendezvous.min_nodes:
                    events += self._end(FAILED, f"{events[-1].message}; fewer than MIN {self.rendezvous.min_nodes} "
                                                "nodes are left")
            return events
        self.rendezvous.leave(node_id, now)
        return [Event("node_left", f"node {node_id} {why}", node_id, self.round_id)]

    def infrastructure_fault(self, node_id: str, cause: str, now: float) -> list[Event]:
        """A fault of a node's infrastructure in a job of roles (its fork server died): its processes start
        again without a new round; it counts in the node's regroup budget, and a node over it is excluded."""
        if self.status != RUNNING:
            return []
        if self._over_budget(node_id, now, 1):
            return self.node_lost(node_id, f"had one infrastructure fault too many ({cause})", now)
        self._recent_regroups(node_id, now).append(now)
        return []

    def _infrastructure_regroup(self, node_id: str, cause: str, now: float) -> list[Event]:
        """A worker ended by a fault of its node's infrastructure (its fork server died): the same nodes regroup
        in a new round, within the node's regroup budget, spending no restart; a node over it is lost."""
        assert self.membership is not None
        if self._over_budget(node_id, now, 1):
            return self.node_lost(node_id, f"had one infrastructure fault too many ({cause})", now)
        count = len(self.membership.members)
        return self._regroup(f"infrastructure fault: {cause}; the same {count} node(s) regroup, no restart spent",
                             now, self.membership.node_ids(), node_id)

    def succeed(self, outcome: str) -> list[Event]:
        """End a running job as succeeded on another part's word (a job of roles: every role finished)."""
        return self._end(SUCCEEDED, outcome) if self.status == RUNNING else []

    def abort(self, reason: str) -> list[Event]:
        """End a running job from outside (Ctrl-C, every agent gone)."""
        return self._end(FAILED, reason) if self.status == RUNNING else []

    def _restart(self, cause: str, now: float) -> list[Event]:
        if self.restart_count >= self.max_restarts:
            return self._end(FAILED, f"{cause}; no restarts left ({self.max_restarts} allowed)")
        self.restart_count += 1
        self.done_nodes.clear()
        expected = self.membership.node_ids() if self.membership is not None else set()
        round_id = self.rendezvous.open_next(now, expected)
        message = f"restart {self.restart_count}/{self.max_restarts}: opening round {round_id}"
        return [Event("restart", message, None, round_id, True)] + self._closed_events()

    def refusal(self, node_id: str) -> str | None:
        """Why a join of ``node_id`` is refused (it flapped too often), or None."""
        return self.excluded.get(node_id)

    def _recent_regroups(self, node_id: str, now: float) -> list[float]:
        recent = [t for t in self.regroups_by_node.get(node_id, []) if now - t < self.regroup_window_s]
        self.regroups_by_node[node_id] = recent
        return recent

    def _over_budget(self, node_id: str, now: float, more: int) -> bool:
        """Whether ``node_id``'s regroups in the window (plus ``more`` about to happen) exceed the budget."""
        return self.max_regroups > 0 and len(self._recent_regroups(node_id, now)) + more > self.max_regroups

    def _exclude(self, node_id: str, now: float, more: int) -> list[Event]:
        count, window = len(self._recent_regroups(node_id, now)) + more, f"{self.regroup_window_s:.0f} s"
        flapped = f"node {node_id} caused {count} regroups in {window} (at most {self.max_regroups} allowed)"
        self.excluded[node_id] = (
            f"node {node_id} is excluded from job {self.job_id}: it caused {count} regroups in {window} (at most "
            f"{self.max_regroups} allowed by --max-regroups per --regroup-window); fix what makes it fail (see its "
            "agent's output), then run it in a new job, or give the job a larger --max-regroups"
        )
        self.rendezvous.leave(node_id, now)
        return [Event("node_excluded", f"{flapped}: excluded from the job, which goes on without it", node_id,
                      self.round_id, True)]

    def _retry_port(self, now: float) -> list[Event]:
        """Another process took MASTER_PORT between the join and rank 0's bind: the same nodes, a new round
        (each agent picks a new port when it joins); the restart budget is not touched."""
        assert self.membership is not None
        taken, expected = self.membership.master_port, self.membership.node_ids()
        self.port_retries += 1
        self.done_nodes.clear()
        round_id = self.rendezvous.open_next(now, expected)
        message = (f"MASTER_PORT {taken} was taken before rank 0 could bind it: opening round {round_id} with a new "
                   f"port (retry {self.port_retries}/{MAX_PORT_RETRIES}, not a restart)")
        return [Event("port_retry", message, None, round_id, True)] + self._closed_events()

    def reconfigure(self, cause: str, now: float) -> list[Event]:
        """The same nodes in a new round, to apply a training config that needs a restart; the restart budget is
        not touched (``reconfigure_count`` counts these)."""
        if self.status != RUNNING or self.membership is None or self.rendezvous.is_open:
            return []
        self.reconfigure_count += 1
        self.done_nodes.clear()
        round_id = self.rendezvous.open_next(now, self.membership.node_ids())
        message = f"{cause}: opening round {round_id} to apply it (not a restart)"
        return [Event("reconfigure", message, None, round_id, True)] + self._closed_events()

    def _regroup(self, cause: str, now: float, expected: set[str], node_id: str) -> list[Event]:
        """Open a round for a membership change (caused by ``node_id``); the restart budget is not touched."""
        self._recent_regroups(node_id, now).append(now)
        self.regroup_count += 1
        self.done_nodes.clear()
        round_id = self.rendezvous.open_next(now, expected)
        return [Event("regroup", f"{cause} (round {round_id})", None, round_id, True)] + self._closed_events()

    def _closed_events(self) -> list[Event]:
        membership = self.membership
        if membership is None or self.announced_round == membership.round_id:
            return []
        self.announced_round = membership.round_id
        nodes = ", ".join(f"node{m.node_rank}={m.host}x{m.nproc}" for m in membership.members)
        size = f"{len(membership.members)} nodes, world size {membership.world_size}"
        message = f"round {membership.round_id}: {size} [{nodes}]"
        carried = len(self.rendezvous.carried)
        if carried:
            message += f"; {carried} of them placed without a join"
        return [Event("round_closed", message, None, membership.round_id, True)]

    def _end(self, status: str, outcome: str, report: WorkerExit | None = None) -> list[Event]:
        self.status, self.outcome = status, f"job {status}: {outcome}"
        if report is not None and report.log_tail:
            tail = "\n".join(f"    {line}" for line in report.log_tail)
            self.outcome += f"\n  last lines of {report.log_path}:\n{tail}"
        return [Event(f"job_{status}", self.outcome, None, self.round_id, True)]
