"""The master's side of a job of roles: ``Roles`` decides, this carries the decisions out.

It places each process on a node of the closed round (least loaded first, a restarted rank back on its node and
port) where its scheduler grants the room, queues the node's assignments and stops for its heartbeat replies
(delivered again until the agent reports on them), feeds the agents' reports into ``Roles``, starts each role
once the roles it waits for have published their addresses (a group's ranks once its rank 0 runs), and ends the
job when every non-service role has finished and the services are stopped. A job of roles needs no round of its
own per change: the round only gathers the nodes; a role group re-forms in rounds of its own.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Callable

from convoy.control.job import RUNNING, Event, Job
from convoy.control.protocol import messages as p
from convoy.control.roles import gang, saved
from convoy.control.roles.members import FINISHED, Decision, FailJob, RestartJob, RestartRole, Roles, Start, Stop
from convoy.control.roles.orders import Key, Orders
from convoy.control.roles.placement import LeastLoaded, Need, Placed, Rooms, Taken
from convoy.control.pool.scheduler import Scheduler, Unbounded
from convoy.control.roles.sizing import RoleSizing
from convoy.errors import ConfigError
from convoy.roles_config import RoleSpec, waits_for


class RoleMaster:
    """Carries out the decisions of ``Roles`` for one job; the caller (JobMaster) holds its lock around each call."""

    def __init__(self, job: Job, specs: tuple[RoleSpec, ...], max_restarts: int, scheduler: Scheduler | None = None,
                 preempt_grace_s: float = 10.0) -> None:
        self.job = job
        self.scheduler: Scheduler = scheduler or Unbounded()
        """Where placement asks for capacity beyond the nodes' own room (a pool shared with other jobs)."""
        self.preempt_grace_s = preempt_grace_s
        """How long a preempted process has to finish its unit of work before SIGTERM."""
        self.pool_waiting: set[Key] = set()
        """Processes waiting for the pool's room (what this job asks of it)."""
        self.releasing: set[Key] = set()
        """Preempted processes told to finish their unit of work: their calls count until they exit."""
        self.specs = {spec.name: spec for spec in specs}
        self.waits = waits_for(tuple(specs))
        """The roles each role starts after (their processes' addresses published first)."""
        self.roles = Roles(specs, max_restarts)
        self.sizing = RoleSizing(specs)
        self.begun = False
        self.pending: list[Start] = []
        self.placed: dict[Key, Placed] = {}
        self.homes: dict[tuple[str, int], tuple[str, int]] = {}
        """(role, rank) -> (node, port) it last ran on: a restart goes back there."""
        self.stopping: set[Key] = set()
        self.orders = Orders()
        """What each node is to be told, until it reports on it."""
        self.lost: dict[str, int] = {}
        """Lost node -> the round it was lost in: nothing is placed on it until a later round has it again."""
        self.exit_hooks: list[Callable[[str, int, int, str], list[Event]]] = []
        """Told of every process exit, (role, rank, incarnation, how): the shard queues take back its shard."""
        self.rooms = Rooms()
        """What each node has for role processes, and who waits for room."""
        self.faults: list[tuple[str, str]] = []
        """The infrastructure faults announced, (node, cause): each is one event however many processes it ended."""

    def advance(self, now: float | None = None) -> list[Event]:
        """Start the roles once the first round has closed, place what waits, and end the job when all is done;
        ``now`` (the master's ticks give it): also fail a role that has waited below its MIN too long."""
        if self.job.status != RUNNING:
            return []
        events: list[Event] = []
        if not self.begun and self.job.membership is not None:
            self.begun = True
            decisions, events = self.roles.start()
            for name in self.sizing.roles:
                decisions += self.roles.start_measuring(name) if self.specs[name].count.auto else []
            events += self.carry_out(decisions)
        events += self._place()
        return events + (self._check_short(now) if now is not None else []) + self._check_done()

    def report(self, report: p.RoleReport) -> list[Event]:
        """An agent's word on one process: started (its address) or exited (its code)."""
        if report.role not in self.specs:
            return [Event("stale_report", f"ignored a report of unknown role {report.role!r}", report.node_id)]
        key = (report.role, report.rank, report.incarnation)
        self.orders.reported(report.node_id, key, exited=report.state == "exited")
        if report.state == "started":
            placed = self.placed.setdefault(key, Placed(report.node_id))
            placed.address = report.address
            port = report.address.rpartition(":")[2]
            if port.isdigit():
                placed.port = int(port)
                self.homes[(report.role, report.rank)] = (report.node_id, placed.port)
            where = ", ".join(filter(None, (report.node_id, f"pid {report.pid}" if report.pid else "",
                                            report.cpu_limit)))
            return self.roles.started(report.role, report.rank, report.incarnation, report.address, where) + \
                self.advance()
        self.placed.pop(key, None)
        self.releasing.discard(key)
        what = f"{report.role} {report.rank} (incarnation {report.incarnation}) {report.describe()}"
        events = [Event("role_exited", what + report.last_lines(), report.node_id)] + self.sizing.exited(key, report)
        for hook in self.exit_hooks:
            events += hook(*key, report.describe())
        live = key not in self.stopping and self.is_current(key) and not report.infrastructure
        measuring_failed = self.sizing.measuring_failed(key, report) if live else None
        relaunch = self.sizing.oom(key, report) if live and report.oom_killed and not measuring_failed else None
        if measuring_failed:
            events += [Event("measuring_failed", measuring_failed),
                       *self.job.abort(measuring_failed + report.last_lines())]
        elif relaunch is not None:
            decisions, more = self.roles.relaunch(report.role, report.rank, report.incarnation, relaunch[1])
            events += more + self.carry_out(decisions)
        elif key in self.stopping:
            self.stopping.discard(key)
            if self.is_current(key):  # a service stopped at the end: it is done
                decisions, more = self.roles.finished(report.role, report.rank, report.incarnation)
                events += more + self.carry_out(decisions)
        elif report.infrastructure:
            events += self._infrastructure_fault(report)
        elif report.exitcode == 0 and not report.start_failed:
            decisions, more = self.roles.finished(report.role, report.rank, report.incarnation)
            events += more + self.carry_out(decisions)
        else:
            decisions, more = self.roles.failed(report.role, report.rank, report.incarnation, report.describe(),
                                                time.monotonic())
            events += more + self.carry_out(decisions, report.last_lines())
        self.job.restart_count = self.roles.restarts_spent()
        return events + self.advance()

    def _infrastructure_fault(self, report: p.RoleReport) -> list[Event]:
        """A process ended by a fault of its node (its fork server died, the node was lost) starts again, spending
        no restart of its role; the fault is one event however many processes it ended, and counts in the node's
        regroup budget (a node over it is excluded, and its processes go elsewhere)."""
        fault = (report.node_id, report.infrastructure)
        events: list[Event] = []
        if fault not in self.faults:
            self.faults = [*self.faults[-63:], fault]
            events.append(Event("infrastructure_fault", f"infrastructure fault: {report.infrastructure}; the role "
                                f"processes it ended start again (no role restart is spent)", report.node_id,
                                console=True))
            events += self.job.infrastructure_fault(report.node_id, report.infrastructure, time.monotonic())
            if self.job.refusal(report.node_id) is not None and report.node_id not in self.lost:
                events += self.node_lost(report.node_id)
        decisions = self.roles.displaced(report.role, report.rank, report.incarnation,
                                         f"was ended by an infrastructure fault ({report.infrastructure})")
        return events + self.carry_out(decisions)

    def memory(self, report: p.MemoryReport) -> list[Event]:
        """A node's memory report: peaks for status, and a role's measuring iteration, which sizes the role."""
        events: list[Event] = []
        for role, rank, incarnation, figures in self.sizing.memory(report):
            if self.is_current((role, rank, incarnation)):
                events += self._size(role, report.node_id, figures)
        return events + self.advance()

    def _size(self, role: str, node_id: str, figures: p.MeasuredIterationReport) -> list[Event]:
        running: dict[str, int] = {}
        for key, placed in self.placed.items():
            if key[0] == role:
                running[placed.node_id] = running.get(placed.node_id, 0) + 1
        waiting = [start.rank for start in self.pending if start.role == role]
        try:
            sized = self.sizing.measured(role, node_id, figures, running, waiting)
        except ConfigError as exc:
            reason = f"role {role} cannot be sized from its measuring iteration: {exc}"
            return [Event("sizing_failed", reason)] + self.job.abort(reason)
        for rank, node in sized.homes.items():
            self.homes[(role, rank)] = (node, 0)
        events = [Event("role_predicted", f"role {role}: {sized.why}", node_id, console=True)]
        if sized.count is not None:
            decisions, more = self.roles.size(role, sized.count, "sized from its measuring iteration")
            events += more + self.carry_out(decisions)
        return events

    def scale(self, role: str, count: int, why: str = "") -> list[Event]:
        """Run ``count`` processes of ``role`` (``why``: who asked and their reason); a ConfigError names the role's
        allowed counts."""
        refused = gang.growth_refused(self, role, count) if role in self.roles.roles else ""
        if refused:
            raise ConfigError(refused)
        decisions, events = self.roles.scale(role, count, why)
        return events + self.carry_out(decisions) + self.advance()

    def node_lost(self, node_id: str) -> list[Event]:
        """A lost node is a change of membership, not a failure: its processes start again on the nodes that
        remain, where their resources fit, and no role spends a restart (the job counts the loss in the node's
        regroup budget, as for a job without roles)."""
        self.orders.forget(node_id)
        self.lost[node_id] = self.job.round_id
        on_it = sorted(key for key, placed in self.placed.items() if placed.node_id == node_id)
        cause = f"node {node_id} was lost"
        self.faults = [*self.faults[-63:], (node_id, cause)]  # the job's regroup says so, and counts it
        listed = ", ".join(f"{role} {rank}" for role, rank, _ in on_it if (role, rank, _) not in self.stopping)
        events = [Event("role_moved", f"{cause}: its role processes ({listed}) start again on the other nodes (no "
                        "role restart is spent)", node_id, console=True)] if listed else []
        for key in on_it:
            self.homes.pop(key[:2], None)
            events += self.report(p.RoleReport(node_id=node_id, role=key[0], rank=key[1], incarnation=key[2],
                                               state="exited", infrastructure=cause))
        return events

    def restart_roles(self, names: Sequence[str], reason: str) -> list[Event]:
        """Every process of ``names`` stops and starts again as a new incarnation of its rank, spending no role
        restart (a whole-job restart, a training-config change those roles must restart for); a service among
        them restarts first, and the other roles' new processes wait for its new address. A ConfigError names a
        role the job does not have."""
        events = self._restart(names, reason)
        return events + self.advance()

    def is_running(self, role: str, rank: int, incarnation: int) -> bool:
        """Whether this process is its rank's current one and has not finished, or a preempted one finishing its unit
        of work (its calls still count)."""
        member = self.roles.roles[role].members.get(rank) if role in self.roles.roles else None
        current = member is not None and member.incarnation == incarnation and member.state != FINISHED
        return current or (role, rank, incarnation) in self.releasing

    def published(self) -> tuple[int, dict[str, list[str]], dict[str, list[int]]]:
        """``(version, addresses, incarnations)``: every role's current addresses by rank (``""`` while a process
        is down) and the incarnation each rank runs as, versioned (heartbeat replies carry them to the agents)."""
        return self.orders.publish(self.roles.addresses(), self.roles.incarnations())

    def has_news(self, node_id: str) -> bool:
        """Whether the node has assignments or stops not sent yet (its heartbeat answers at once)."""
        return self.orders.has_news(node_id)

    def deliver(self, node_id: str, now: float) -> tuple[list[p.RoleAssignment], list[p.RoleStop]]:
        """What to tell the node now: what it was not told yet, or was told over REDELIVER_S ago."""
        return self.orders.deliver(node_id, now)

    def state(self) -> dict[str, Any]:
        """Everything a restarted master needs to take the running role processes back (JSON-ready)."""
        return saved.state(self)

    def load_state(self, state: dict[str, Any]) -> list[Event]:
        """Take back a previous master's roles: the processes run on (their agents reattach and report), and
        what it had not heard back about is told again at once."""
        return saved.load_state(self, state)

    def carry_out(self, decisions: list[Decision], tail: str = "") -> list[Event]:
        """Do what ``Roles`` decided (``tail``: the failed process's last lines, for a failure of the job)."""
        events: list[Event] = []
        for decision in decisions:
            if isinstance(decision, Start):
                if decision.anywhere:
                    self.homes.pop((decision.role, decision.rank), None)
                self.pending.append(decision)
            elif isinstance(decision, Stop):
                self._stop(decision.role, decision.rank, decision.reason,
                           self.preempt_grace_s if decision.notice else 0.0)
            elif isinstance(decision, RestartJob):
                events += self._restart(list(self.roles.roles), decision.reason)
            elif isinstance(decision, RestartRole):
                events += self._restart([decision.role], decision.reason,
                                        self.preempt_grace_s if decision.notice else 0.0)
            elif isinstance(decision, FailJob):
                events += self.job.abort(decision.reason + tail)
        return events

    def _stop(self, role: str, rank: int, reason: str, notice_s: float = 0.0, release: bool = True) -> None:
        """SIGTERM the rank's processes now, or tell them first (``notice_s``); ``release``: their share is freed."""
        self.pending = [start for start in self.pending if (start.role, start.rank) != (role, rank)]
        for key, placed in self.placed.items():
            if key[:2] == (role, rank) and key not in self.stopping:
                self.stopping.add(key)
                if notice_s and release:
                    self.releasing.add(key)
                self.orders.stop(placed.node_id, p.RoleStop(role=role, rank=rank, incarnation=key[2], reason=reason,
                                                            notice_s=notice_s))

    def _restart(self, names: Sequence[str], reason: str, notice_s: float = 0.0) -> list[Event]:
        starts = self.roles.restart(names, reason)  # a ConfigError before anything changed, for an unknown role
        for role, rank, _ in list(self.placed):
            if role in names:
                self._stop(role, rank, reason, notice_s, release=False)
        self.pending = [start for start in self.pending if start.role not in names] + starts
        which = "every role process" if set(names) >= set(self.roles.roles) else \
            f"every process of role(s) {', '.join(names)}"
        return [Event("roles_restarted", f"{which} starts again: {reason}", console=True)]

    def _place(self) -> list[Event]:
        """Assign what waits to nodes with room for it; non-service roles wait until every service has an address,
        and a process no node has room for waits, said once (its role runs below its count meanwhile)."""
        if not self.pending:  # (before the nodes: each tick asks, and a list of thousands is not free)
            return []
        nodes = self.live_nodes()
        if not nodes:
            return []
        ready = {name: bool(state.members) and all(member.address for member in state.members.values())
                 for name, state in self.roles.roles.items()}
        taken, waiting, events = self.taken(), [], []
        least = LeastLoaded(nodes, taken)
        counts = Counter(key[0] for key in self.placed if self.is_current(key))
        addresses = {name: listed for name, listed in self.roles.addresses().items() if listed and all(listed)}
        whole: dict[str, bool] = {}
        for start in self.pending:
            key = (start.role, start.rank, start.incarnation)
            if not self.is_current(key):
                continue  # replaced or scaled away before it was placed
            if self.specs[start.role].group and start.role not in whole:
                whole[start.role], said = gang.placed_whole(self, start.role, nodes, taken)
                events += said
            if not whole.get(start.role, True):
                waiting.append(start)
                continue
            if not all(ready[name] for name in self.waits[start.role]) or self.sizing.waits(start.role, start.rank) \
                    or (start.rank and not self.roles.group_address(start.role)):
                waiting.append(start)
                continue
            home, port = self.homes.get((start.role, start.rank), ("", 0))
            choice, said = self.rooms.place(key, self.need(start.role, start.rank), nodes, taken, home,
                                            counts[start.role], self.roles.world_size(start.role),
                                            self.specs[start.role].count.minimum, least)
            events += said
            if choice is None:
                waiting.append(start)
                continue
            if not self.scheduler.take(self.need(start.role, start.rank).amount()):
                self.pool_waiting.add(key)  # what this job asks of the pool: jobs of lower priority give it back
                waiting.append(start)
                continue
            self.pool_waiting.discard(key)
            counts[start.role] += 1
            events.append(self._assign(start, choice.node_id, port if choice.node_id == home else 0, addresses,
                                       choice.gpus))
        self.pending = waiting
        return events

    def node_room(self, node_id: str, memory_bytes: int, cpus: float, gpus: int) -> None:
        """What a node reported when it joined (its first join's figures stand): the room its processes take."""
        self.rooms.node_joined(node_id, memory_bytes, cpus, gpus)

    def need(self, role: str, rank: int) -> Need:
        """What one process of the role takes: its memory limit, CPUs and GPUs."""
        spec = self.specs[role]
        return Need(self.sizing.limit_for(role, rank), spec.cpus or 0.0, spec.gpus)

    def live_nodes(self) -> list[str]:
        """The closed round's nodes not lost since (what processes are placed on)."""
        membership = self.job.membership
        return [] if membership is None else [member.node_id for member in membership.members
                                              if self.lost.get(member.node_id, -1) < membership.round_id]

    def taken(self) -> dict[str, Taken]:
        taken: dict[str, Taken] = {}
        for (role, rank, _), placed in self.placed.items():
            taken.setdefault(placed.node_id, Taken()).add(self.need(role, rank), placed.gpus)
        return taken

    def _placed_count(self, role: str) -> int:
        return sum(1 for key in self.placed if key[0] == role and self.is_current(key))

    def _check_short(self, now: float) -> list[Event]:
        """Fail the job once a role has stayed below its MIN for want of room as long as a round may wait for its
        MIN nodes (``join_timeout_s``): a node with room has not come."""
        for name, state in self.roles.roles.items():
            waiting = [start for start in self.pending
                       if start.role == name and (name, start.rank, start.incarnation) in self.rooms.told_waiting]
            minimum, placed = state.spec.count.minimum, self._placed_count(name)
            short = bool(waiting) and not state.spec.count.auto and placed < minimum
            waited = self.rooms.below_min_too_long(name, short, now, self.job.join_timeout_s)
            if waited is not None:
                return self.job.abort(f"role {name} has had {placed} of its MIN {minimum} process(es) placed for "
                                      f"{waited:.0f} s: no node has room for one more (each needs "
                                      f"{self.need(name, waiting[0].rank).describe()}); add a node, or lower the "
                                      "role's count or resources")
        return []

    def _assign(self, start: Start, node_id: str, port: int, addresses: dict[str, list[str]],
                gpus: tuple[int, ...] = ()) -> Event:
        """``addresses``: the roles whose every process has one (made once per placing pass)."""
        key = (start.role, start.rank, start.incarnation)
        spec = self.specs[start.role]
        assignment = p.RoleAssignment(
            role=start.role, rank=start.rank, incarnation=start.incarnation, restore=start.restore, port=port,
            world_size=self.roles.world_size(start.role), addresses=addresses, entrypoint=spec.entrypoint,
            module=spec.module, args=list(spec.args), reason=start.reason,
            memory_limit_bytes=self.sizing.limit_for(start.role, start.rank),
            measure=self.sizing.measures(start.role, start.rank),
            threads=max(1, int(spec.cpus)) if spec.cpus else 0, cpus=spec.cpus or 0.0, gpus=list(gpus),
            gpus_managed=any(other.gpus for other in self.specs.values()),
            group_round=self.roles.group_round(start.role),
            group_address=self.roles.group_address(start.role) if spec.group and start.rank else "",
        )
        self.placed[key] = Placed(node_id, port, gpus=list(gpus))
        self.sizing.placed(key, node_id)
        self.orders.assign(node_id, assignment)
        again = " (restored)" if start.restore else ""
        return Event("role_placed", f"{start.role} {start.rank} (incarnation {start.incarnation}) on node "
                                    f"{node_id}{again}: {start.reason}", node_id)

    def _check_done(self) -> list[Event]:
        if not self.roles.done() or any(key[0] in self.roles.services for key in self.placed):
            return []
        counts = ", ".join(f"{name} x{len(state.members)}" for name, state in self.roles.roles.items())
        return self.job.succeed(f"every role finished ({counts})")

    def is_current(self, key: Key) -> bool:
        member = self.roles.roles[key[0]].members.get(key[1])
        return member is not None and member.incarnation == key[2]

