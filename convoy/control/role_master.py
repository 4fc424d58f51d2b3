"""The master's side of a job of roles: ``Roles`` decides, this carries the decisions out.

It places each process on a node of the closed round (least loaded first, a restarted rank back on its node and
port), queues the node's assignments and stops for its heartbeat replies (delivered again until the agent
reports on them), feeds the agents' reports into ``Roles``, starts the non-service roles only once every
service process (ps) has published its address, and ends the job when every role has finished and the services
are stopped. The roles do not share a torch.distributed world (the PS data plane talks over its own sockets), so
a job of roles needs no round of its own per change: the round only gathers the nodes.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from convoy.control import protocol as p
from convoy.control.job import RUNNING, Event, Job
from convoy.control.role_sizing import RoleSizing
from convoy.control.roles import FINISHED, SERVICE_ROLES, STARTING, Decision, FailJob, RestartJob, Roles, Start, Stop
from convoy.errors import ConfigError
from convoy.roles_config import RESTORE_ONE, RoleCount, RoleSpec

ROLES_FILE = "roles.json"
ROLES_PART = "roles"
"""The name of the roles' state among the master's saved parts (``Store.parts``)."""
"""Where the launcher leaves the job's roles in the run dir for the master (a job without it has none)."""
REDELIVER_S = 2.0
"""An assignment or stop the agent has not reported on is sent again in its heartbeat after this long."""
NEVER = -math.inf
Key = tuple[str, int, int]
"""(role, rank, incarnation): one process."""


def save_roles(run_dir: Path, roles: tuple[RoleSpec, ...]) -> None:
    """Write the roles for the master (``convoy run`` starts the master as a process of its own)."""
    (Path(run_dir) / ROLES_FILE).write_text(json.dumps([asdict(role) for role in roles], indent=1))


def load_roles(run_dir: Path) -> tuple[RoleSpec, ...]:
    """The roles ``save_roles`` wrote; none for a job without the file."""
    path = Path(run_dir) / ROLES_FILE
    if not path.is_file():
        return ()
    try:
        listed = json.loads(path.read_text())
        roles = tuple(RoleSpec(**{**role, "args": tuple(role["args"]), "count": RoleCount(**role["count"])})
                      for role in listed)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{path} does not hold the job's roles ({exc}); start the job again with convoy run") from exc
    for role in roles:
        role.validate()
    return roles


@dataclass
class Placed:
    node_id: str
    port: int = 0
    address: str = ""


@dataclass
class Outbox:
    """What a node is to be told, with when it was last sent (NEVER: not yet)."""

    assignments: dict[Key, tuple[p.RoleAssignment, float]] = field(default_factory=dict)
    stops: dict[Key, tuple[p.RoleStop, float]] = field(default_factory=dict)


class RoleMaster:
    """Carries out the decisions of ``Roles`` for one job; the caller (JobMaster) holds its lock around each call."""

    def __init__(self, job: Job, specs: tuple[RoleSpec, ...], max_restarts: int) -> None:
        self.job = job
        self.specs = {spec.name: spec for spec in specs}
        self.roles = Roles(specs, max_restarts)
        self.sizing = RoleSizing(specs)
        self.begun = False
        self.pending: list[Start] = []
        self.placed: dict[Key, Placed] = {}
        self.homes: dict[tuple[str, int], tuple[str, int]] = {}
        """(role, rank) -> (node, port) it last ran on: a restart goes back there."""
        self.stopping: set[Key] = set()
        self.outboxes: dict[str, Outbox] = {}
        self.lost: dict[str, int] = {}
        """Lost node -> the round it was lost in: nothing is placed on it until a later round has it again."""
        self.exit_hooks: list[Callable[[str, int, int, str], list[Event]]] = []
        """Told of every process exit, (role, rank, incarnation, how): the shard queues take back its shard."""
        self._published: tuple[int, dict[str, list[str]], dict[str, list[int]]] = (0, {}, {})

    def advance(self) -> list[Event]:
        """Start the roles once the first round has closed, place what waits, and end the job when all is done."""
        if self.job.status != RUNNING:
            return []
        events: list[Event] = []
        if not self.begun and self.job.membership is not None:
            self.begun = True
            decisions, events = self.roles.start()
            for name in self.sizing.roles:
                decisions += self.roles.start_measuring(name) if self.specs[name].count.auto else []
            events += self._carry_out(decisions)
        events += self._place()
        return events + self._check_done()

    def report(self, report: p.RoleReport) -> list[Event]:
        """An agent's word on one process: started (its address) or exited (its code)."""
        if report.role not in self.specs:
            return [Event("stale_report", f"ignored a report of unknown role {report.role!r}", report.node_id)]
        key = (report.role, report.rank, report.incarnation)
        outbox = self.outboxes.setdefault(report.node_id, Outbox())
        outbox.assignments.pop(key, None)
        if report.state == "started":
            placed = self.placed.setdefault(key, Placed(report.node_id))
            placed.address = report.address
            port = report.address.rpartition(":")[2]
            if port.isdigit():
                placed.port = int(port)
                self.homes[(report.role, report.rank)] = (report.node_id, placed.port)
            return self.roles.started(report.role, report.rank, report.incarnation, report.address,
                                      f"{report.node_id}, pid {report.pid}" if report.pid else report.node_id) + \
                self.advance()
        outbox.stops.pop(key, None)
        self.placed.pop(key, None)
        what = f"{report.role} {report.rank} (incarnation {report.incarnation}) {report.describe()}"
        events = [Event("role_exited", what + _tail(report), report.node_id)] + self.sizing.exited(key, report)
        for hook in self.exit_hooks:
            events += hook(*key, report.describe())
        live = key not in self.stopping and self._is_current(key)
        measuring_failed = self.sizing.measuring_failed(key, report) if live else None
        relaunch = self.sizing.oom(key, report) if live and report.oom_killed and not measuring_failed else None
        if measuring_failed:
            events += [Event("measuring_failed", measuring_failed)] + self.job.abort(measuring_failed + _tail(report))
        elif relaunch is not None:
            decisions, more = self.roles.relaunch(report.role, report.rank, report.incarnation, relaunch[1])
            events += more + self._carry_out(decisions)
        elif key in self.stopping:
            self.stopping.discard(key)
            if self._is_current(key):  # a service stopped at the end: it is done
                decisions, more = self.roles.finished(report.role, report.rank, report.incarnation)
                events += more + self._carry_out(decisions)
        elif report.exitcode == 0 and not report.start_failed:
            decisions, more = self.roles.finished(report.role, report.rank, report.incarnation)
            events += more + self._carry_out(decisions)
        else:
            decisions, more = self.roles.failed(report.role, report.rank, report.incarnation, report.describe())
            events += more + self._carry_out(decisions, _tail(report))
        return events + self.advance()

    def memory(self, report: p.MemoryReport) -> list[Event]:
        """A node's memory report: peaks for status, and a role's measuring iteration, which sizes the role."""
        events: list[Event] = []
        for role, rank, incarnation, figures in self.sizing.memory(report):
            if self._is_current((role, rank, incarnation)):
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
            events += more + self._carry_out(decisions)
        return events

    def scale(self, role: str, count: int) -> list[Event]:
        """Run ``count`` processes of ``role``; a ConfigError names the role's allowed counts."""
        decisions, events = self.roles.scale(role, count)
        return events + self._carry_out(decisions) + self.advance()

    def node_lost(self, node_id: str) -> list[Event]:
        """The processes of a lost node count as failed: their roles' policies place them on the other nodes."""
        self.outboxes.pop(node_id, None)
        self.lost[node_id] = self.job.round_id
        events: list[Event] = []
        for key in [key for key, placed in self.placed.items() if placed.node_id == node_id]:
            self.homes.pop(key[:2], None)
            events += self.report(p.RoleReport(node_id=node_id, role=key[0], rank=key[1], incarnation=key[2],
                                               state="exited", signal=f"the loss of node {node_id}"))
        return events

    def is_running(self, role: str, rank: int, incarnation: int) -> bool:
        """Whether this process is its rank's current one and has not finished (its calls still count)."""
        member = self.roles.roles[role].members.get(rank) if role in self.roles.roles else None
        return member is not None and member.incarnation == incarnation and member.state != FINISHED
    def published(self) -> tuple[int, dict[str, list[str]], dict[str, list[int]]]:
        """``(version, addresses, incarnations)``: every role's current addresses by rank (``""`` while a process
        is down) and the incarnation each rank runs as, the version grown by one whenever either changes
        (heartbeat replies carry them to the agents)."""
        current = (self.roles.addresses(), self.roles.incarnations())
        if current != self._published[1:]:
            self._published = (self._published[0] + 1, *current)
        return self._published

    def has_news(self, node_id: str) -> bool:
        """Whether the node has assignments or stops not sent yet (its heartbeat answers at once)."""
        outbox = self.outboxes.get(node_id)
        return outbox is not None and any(sent == NEVER for _, sent in [*outbox.assignments.values(),
                                                                          *outbox.stops.values()])

    def deliver(self, node_id: str, now: float) -> tuple[list[p.RoleAssignment], list[p.RoleStop]]:
        """What to tell the node now: what it was not told yet, or was told over REDELIVER_S ago."""
        outbox = self.outboxes.get(node_id)
        if outbox is None:
            return [], []
        assignments, stops = [], []
        for key, (assignment, sent) in list(outbox.assignments.items()):
            if now - sent >= REDELIVER_S:
                assignments.append(assignment)
                outbox.assignments[key] = (assignment, now)
        for key, (stop, sent) in list(outbox.stops.items()):
            if now - sent >= REDELIVER_S:
                stops.append(stop)
                outbox.stops[key] = (stop, now)
        return assignments, stops

    def state(self) -> dict[str, Any]:
        """Everything a restarted master needs to take the running role processes back (JSON-ready)."""
        return {
            "roles": self.roles.state(), "sizing": self.sizing.state(), "begun": self.begun,
            "pending": [asdict(start) for start in self.pending],
            "placed": [[*key, asdict(placed)] for key, placed in self.placed.items()],
            "homes": [[*key, *home] for key, home in self.homes.items()],
            "stopping": [list(key) for key in self.stopping], "lost": self.lost, "published": list(self._published),
            "outboxes": {node: {"assignments": [a.model_dump(mode="json") for a, _ in box.assignments.values()],
                                "stops": [stop.model_dump(mode="json") for stop, _ in box.stops.values()]}
                         for node, box in self.outboxes.items()},
        }

    def load_state(self, saved: dict[str, Any]) -> list[Event]:
        """Take back a previous master's roles: the processes run on (their agents reattach and report), and
        what it had not heard back about is told again at once."""
        self.roles.load_state(saved["roles"])
        self.sizing.load_state(saved["sizing"])
        self.begun = saved["begun"]
        self.pending = [Start(**start) for start in saved["pending"]]
        self.placed = {(role, rank, inc): Placed(**placed) for role, rank, inc, placed in saved["placed"]}
        self.homes = {(role, rank): (node, port) for role, rank, node, port in saved["homes"]}
        self.stopping = {(role, rank, inc) for role, rank, inc in saved["stopping"]}
        self.lost = dict(saved["lost"])
        version, addresses, incarnations = saved["published"]
        self._published = (version, addresses, incarnations)  # agents hold this version: a change goes above it
        for node, box in saved["outboxes"].items():
            outbox = self.outboxes.setdefault(node, Outbox())
            for assignment in map(p.RoleAssignment.model_validate, box["assignments"]):
                outbox.assignments[(assignment.role, assignment.rank, assignment.incarnation)] = (assignment, NEVER)
            for stop in map(p.RoleStop.model_validate, box["stops"]):
                outbox.stops[(stop.role, stop.rank, stop.incarnation)] = (stop, NEVER)
        running = sum(1 for key in self.placed if self._is_current(key))
        return [Event("roles_resumed", f"the restarted master takes back {running} role process(es); "
                                       f"{len(self.pending)} wait to be placed", console=True)]

    def _carry_out(self, decisions: list[Decision], tail: str = "") -> list[Event]:
        events: list[Event] = []
        for decision in decisions:
            if isinstance(decision, Start):
                self.pending.append(decision)
            elif isinstance(decision, Stop):
                self._stop(decision.role, decision.rank, decision.reason)
            elif isinstance(decision, RestartJob):
                events += self._restart_all(decision.reason)
            elif isinstance(decision, FailJob):
                events += self.job.abort(decision.reason + tail)
        return events

    def _stop(self, role: str, rank: int, reason: str) -> None:
        self.pending = [start for start in self.pending if (start.role, start.rank) != (role, rank)]
        for key, placed in self.placed.items():
            if key[:2] == (role, rank) and key not in self.stopping:
                self.stopping.add(key)
                outbox = self.outboxes.setdefault(placed.node_id, Outbox())
                outbox.assignments.pop(key, None)
                outbox.stops[key] = (p.RoleStop(role=role, rank=rank, incarnation=key[2], reason=reason), NEVER)

    def _restart_all(self, reason: str) -> list[Event]:
        """Every process stops and starts again as a new incarnation of its rank (services first)."""
        for role, rank, _ in list(self.placed):
            self._stop(role, rank, reason)
        self.pending = []
        for name, state in self.roles.roles.items():
            for rank, member in sorted(state.members.items()):
                member.incarnation, member.state, member.address = state.launch(), STARTING, ""
                self.pending.append(Start(name, rank, state.spec.failure_policy == RESTORE_ONE, reason,
                                          member.incarnation))
        return [Event("roles_restarted", f"every role process starts again: {reason}", console=True)]

    def _place(self) -> list[Event]:
        """Assign what waits to nodes; non-service roles wait until every service has an address."""
        membership = self.job.membership
        if membership is None or not self.pending:
            return []
        nodes = [member.node_id for member in membership.members
                 if self.lost.get(member.node_id, -1) < membership.round_id]
        if not nodes:
            return []
        services_ready = all(member.address for name in SERVICE_ROLES if name in self.roles.roles
                             for member in self.roles.roles[name].members.values())
        events, waiting = [], []
        for start in self.pending:
            if not self._is_current((start.role, start.rank, start.incarnation)):
                continue  # replaced or scaled away before it was placed
            if (start.role not in SERVICE_ROLES and not services_ready) or self.sizing.waits(start.role, start.rank):
                waiting.append(start)
                continue
            home, port = self.homes.get((start.role, start.rank), ("", 0))
            if home not in nodes:
                loads = {node: 0 for node in nodes}
                for placed in self.placed.values():
                    if placed.node_id in loads:
                        loads[placed.node_id] += 1
                home, port = min(nodes, key=lambda node: loads[node]), 0
            events.append(self._assign(start, home, port))
        self.pending = waiting
        return events

    def _assign(self, start: Start, node_id: str, port: int) -> Event:
        key = (start.role, start.rank, start.incarnation)
        spec = self.specs[start.role]
        addresses = {name: listed for name, listed in self.roles.addresses().items() if listed and all(listed)}
        assignment = p.RoleAssignment(
            role=start.role, rank=start.rank, incarnation=start.incarnation, restore=start.restore, port=port,
            world_size=self.roles.world_size(start.role), addresses=addresses, entrypoint=spec.entrypoint,
            module=spec.module, args=list(spec.args), reason=start.reason,
            memory_limit_bytes=self.sizing.limit_for(start.role, start.rank),
            measure=self.sizing.measures(start.role, start.rank),
            threads=max(1, int(spec.cpus)) if spec.cpus else 0,
        )
        self.placed[key] = Placed(node_id, port)
        self.sizing.placed(key, node_id)
        self.outboxes.setdefault(node_id, Outbox()).assignments[key] = (assignment, NEVER)
        again = " (restored)" if start.restore else ""
        return Event("role_placed", f"{start.role} {start.rank} (incarnation {start.incarnation}) on node "
                                    f"{node_id}{again}: {start.reason}", node_id)

    def _check_done(self) -> list[Event]:
        if not self.roles.done() or any(key[0] in SERVICE_ROLES for key in self.placed):
            return []
        counts = ", ".join(f"{name} x{len(state.members)}" for name, state in self.roles.roles.items())
        return self.job.succeed(f"every role finished ({counts})")

    def _is_current(self, key: Key) -> bool:
        member = self.roles.roles[key[0]].members.get(key[1])
        return member is not None and member.incarnation == key[2]


def _tail(report: p.RoleReport) -> str:
    if not report.log_tail:
        return ""
    lines = "\n".join(f"    {line}" for line in report.log_tail[-10:])
    return f"\n  last lines of {report.log_path or 'its log'}:\n{lines}"
