"""A job's roles as a pure state machine: who holds which rank of each role, what a failure or a scale
request leads to, and the events of each change.

Every call returns the decisions the master carries out (start or stop one process, a new round for the
job, the job's failure) and the events to record; no I/O happens here. Role ranks are stable: a restarted
process keeps its rank, scaling down stops the highest ranks, scaling up fills the lowest free ones.
Model: ``control/job.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from convoy.control.job import Event
from convoy.errors import ConfigError
from convoy.roles_config import FIXED_COUNT, RESTART_JOB, RESTORE_ONE, RoleSpec

SERVICE_ROLES = ("ps",)
"""Roles that serve the others: they run until every other role has finished, then they are stopped."""
STARTING, RUNNING, FINISHED = "starting", "running", "finished"


@dataclass(frozen=True)
class Start:
    """Start the process of ``role`` rank ``rank``; ``restore``: it takes back the state its rank had."""

    role: str
    rank: int
    restore: bool = False
    reason: str = ""
    incarnation: int = 0
    """Which launch of the role this process is (never reused): its reports carry it, so a late report of an
    earlier process of the rank is told apart and ignored."""


@dataclass(frozen=True)
class Stop:
    """Stop the process of ``role`` rank ``rank`` (scaled down, or a service no one needs any more)."""

    role: str
    rank: int
    reason: str = ""


@dataclass(frozen=True)
class RestartJob:
    """Open a new round for the whole job (the failed role's policy asks for it)."""

    reason: str


@dataclass(frozen=True)
class FailJob:
    reason: str


Decision = Start | Stop | RestartJob | FailJob


@dataclass
class Member:
    incarnation: int
    state: str = STARTING
    address: str = ""
    restarts: int = 0


@dataclass
class RoleState:
    spec: RoleSpec
    target: int
    """How many processes the role should run now (0 for an ``auto`` role not sized yet)."""
    members: dict[int, Member] = field(default_factory=dict)
    restarts: int = 0
    launches: int = 0
    """Processes of the role started so far: the next one's incarnation."""

    def launch(self) -> int:
        self.launches += 1
        return self.launches - 1


class Roles:
    """Membership, scaling and failure policy per role. ``max_restarts``: per role, of its processes in all."""

    def __init__(self, specs: Sequence[RoleSpec], max_restarts: int) -> None:
        if not specs:
            raise ConfigError("a job of roles needs at least one role")
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"roles named twice: {sorted({n for n in names if names.count(n) > 1})}")
        self.max_restarts = max_restarts
        self.roles = {spec.name: RoleState(spec, 0 if spec.count.auto else spec.count.minimum) for spec in specs}
        self.failed_reason = ""

    def start(self) -> tuple[list[Decision], list[Event]]:
        """The processes to start first: every role at its count; ``auto`` roles wait for ``size``."""
        decisions: list[Decision] = []
        events = []
        for name, state in self.roles.items():
            decisions += self._fill(state, "the job starts")
            counted = "auto: sized once measured" if state.spec.count.auto else str(state.target)
            events.append(Event("role_declared", f"role {name}: {counted} process(es), on failure "
                                                 f"{state.spec.failure_policy}"))
        return decisions, events

    def started(self, role: str, rank: int, incarnation: int, address: str = "", process: str = "") -> list[Event]:
        """``process``: where it runs, as ``NODE, pid N`` (or the node alone)."""
        member = self._current(role, rank, incarnation)
        if member is None or member.state == FINISHED or (member.state, member.address) == (RUNNING, address):
            return []  # not the rank's process, or a late repeat of a report already taken
        member.state, member.address = RUNNING, address
        where = f" at {address}" if address else ""
        return [Event("role_started", f"{role} {rank} is running{where}" + (f" ({process})" if process else ""))]

    def finished(self, role: str, rank: int, incarnation: int) -> tuple[list[Decision], list[Event]]:
        """A process exited 0. When every process of the non-service roles has, the services are stopped."""
        member = self._current(role, rank, incarnation)
        if member is None:
            return [], []
        member.state = FINISHED
        events = [Event("role_finished", f"{role} {rank} finished")]
        decisions: list[Decision] = []
        if self.done():
            for name in SERVICE_ROLES:
                state = self.roles.get(name)
                for member_rank, member in sorted(state.members.items()) if state else ():
                    if member.state != FINISHED:
                        decisions.append(Stop(name, member_rank, "every other role has finished"))
        return decisions, events

    def failed(self, role: str, rank: int, incarnation: int, why: str) -> tuple[list[Decision], list[Event]]:
        """A process failed: its role's policy says what follows, within the role's restart budget. The exit
        of a process that was stopped on purpose (scaled away) or replaced already is ignored."""
        state = self.roles[self._known(role)]
        member = self._current(role, rank, incarnation)
        if member is None or self.failed_reason:
            return [], []
        policy = state.spec.failure_policy
        if state.restarts >= self.max_restarts:
            self.failed_reason = (f"{role} {rank} failed ({why}) and role {role} has used its {self.max_restarts} "
                                  "restart(s)")
            return [FailJob(self.failed_reason)], [Event("job_failed", self.failed_reason, console=True)]
        state.restarts += 1
        member.restarts += 1
        member.state, member.address, member.incarnation = STARTING, "", state.launch()
        if policy == RESTART_JOB:
            reason = f"{role} {rank} failed ({why}); role {role} restarts the whole job"
            return [RestartJob(reason)], [Event("role_failed", reason, console=True)]
        restore = policy == RESTORE_ONE
        reason = (f"{role} {rank} failed ({why}); restarting only it" + (" with its state" if restore else "")
                  + f" (restart {state.restarts} of {self.max_restarts} for role {role})")
        return [Start(role, rank, restore, reason, member.incarnation)], [Event("role_failed", reason, console=True)]

    def displaced(self, role: str, rank: int, incarnation: int, why: str) -> list[Decision]:
        """A process lost to a fault of its node, not of its own (the node lost, its fork server dead): it starts
        again as a new incarnation, wherever the master can place it, and its role spends no restart. A role
        whose policy restarts the job restarts it, spending no restart either."""
        member = self._current(role, rank, incarnation)
        if member is None or member.state == FINISHED or self.failed_reason:
            return []
        state = self.roles[role]
        if state.spec.failure_policy == RESTART_JOB:
            return [RestartJob(f"{role} {rank} {why}; role {role} restarts the whole job (no restart spent)")]
        member.state, member.address, member.incarnation = STARTING, "", state.launch()
        return [Start(role, rank, state.spec.failure_policy == RESTORE_ONE, f"{role} {rank} {why}",
                      member.incarnation)]

    def restart(self, names: Sequence[str], reason: str) -> list[Start]:
        """Every process of ``names`` starts again as a new incarnation of its rank, a finished one too, as
        torchelastic restarts a whole group (a whole-job restart, or a change of the training config those roles
        must restart for); no restart is counted here."""
        starts = []
        for name in [self._known(name) for name in names]:  # every name known before anything changes
            state = self.roles[name]
            for rank, member in sorted(state.members.items()):
                member.incarnation, member.state, member.address = state.launch(), STARTING, ""
                starts.append(Start(name, rank, state.spec.failure_policy == RESTORE_ONE, reason, member.incarnation))
        return starts

    def restarts_spent(self) -> int:
        """Restarts the job's roles have spent in all (what the job's end reports)."""
        return sum(state.restarts for state in self.roles.values())

    def scale(self, role: str, count: int) -> tuple[list[Decision], list[Event]]:
        """Run ``count`` processes of ``role``: start the lowest free ranks or stop the highest ones."""
        state = self.roles[self._known(role)]
        count_spec = state.spec.count
        if role in FIXED_COUNT and count != state.target:
            raise ConfigError(f"role {role} cannot change its count ({state.target}): {FIXED_COUNT[role]}")
        low, high = (1, None) if count_spec.auto else (count_spec.minimum, count_spec.maximum)
        if count < low or (high is not None and count > high):
            allowed = f"{low} or more" if high is None else f"{low}..{high}"
            raise ConfigError(f"role {role} can run {allowed} processes (its count is {count_spec}), not {count}")
        before, state.target = state.target, count
        decisions: list[Decision] = []
        for rank in sorted(state.members, reverse=True)[: max(0, len(state.members) - count)]:
            decisions.append(Stop(role, rank, f"role {role} scaled to {count}"))
            del state.members[rank]
        decisions += self._fill(state, f"role {role} scaled to {count}")
        return decisions, [Event("role_scaled", f"role {role}: {before} -> {count} process(es)", console=True)]

    def size(self, role: str, count: int, why: str) -> tuple[list[Decision], list[Event]]:
        """Give an ``auto`` role its count, decided by the master (from one measured iteration)."""
        decisions, _ = self.scale(role, count)
        return decisions, [Event("role_sized", f"role {role}: {count} process(es): {why}", console=True)]

    def start_measuring(self, role: str) -> list[Decision]:
        """An ``auto`` role's rank 0 alone: it measures the iteration the rest of the role is sized from."""
        state = self.roles[self._known(role)]
        state.target = max(state.target, 1)
        return self._fill(state, "it measures one iteration to size the role")

    def relaunch(self, role: str, rank: int, incarnation: int, reason: str) -> tuple[list[Decision], list[Event]]:
        """Start the rank again alone, outside the restart budget (the master raised its memory limit)."""
        member = self._current(role, rank, incarnation)
        if member is None or self.failed_reason:
            return [], []
        member.state, member.address = STARTING, ""
        member.incarnation = self.roles[role].launch()
        return [Start(role, rank, False, reason, member.incarnation)], [Event("role_relaunched", reason, console=True)]

    def done(self) -> bool:
        """Every process of every non-service role has finished (and each such role has some)."""
        working = [state for name, state in self.roles.items() if name not in SERVICE_ROLES]
        return bool(working) and all(
            state.members and all(m.state == FINISHED for m in state.members.values()) for state in working)

    def addresses(self) -> dict[str, list[str]]:
        """Each role's published addresses by rank (empty strings where a process has none yet)."""
        return {name: [state.members[r].address for r in sorted(state.members)]
                for name, state in self.roles.items()}

    def incarnations(self) -> dict[str, list[int]]:
        """Each role's current incarnation by rank, in the order of ``addresses``."""
        return {name: [state.members[r].incarnation for r in sorted(state.members)]
                for name, state in self.roles.items()}

    def world_size(self, role: str) -> int:
        return len(self.roles[self._known(role)].members)

    def state(self) -> dict[str, Any]:
        """What a restarted master needs to take the roles back (JSON-ready; the specs come from roles.json)."""
        return {"failed_reason": self.failed_reason, "roles": {
            name: {"target": state.target, "restarts": state.restarts, "launches": state.launches,
                   "members": {str(rank): asdict(member) for rank, member in state.members.items()}}
            for name, state in self.roles.items()}}

    def load_state(self, saved: dict[str, Any]) -> None:
        """Take back what ``state()`` gave; a ConfigError when it names roles this job does not declare."""
        unknown = sorted(set(saved["roles"]) - set(self.roles))
        if unknown:
            raise ConfigError(f"the saved state names roles {unknown} that roles.json does not declare")
        self.failed_reason = saved["failed_reason"]
        for name, entry in saved["roles"].items():
            state = self.roles[name]
            state.target, state.restarts, state.launches = entry["target"], entry["restarts"], entry["launches"]
            state.members = {int(rank): Member(**member) for rank, member in entry["members"].items()}

    def _fill(self, state: RoleState, reason: str) -> list[Decision]:
        decisions: list[Decision] = []
        rank = 0
        while len(state.members) < state.target:
            if rank not in state.members:
                state.members[rank] = Member(state.launch())
                decisions.append(Start(state.spec.name, rank, False, reason, state.members[rank].incarnation))
            rank += 1
        return decisions

    def _known(self, role: str) -> str:
        if role not in self.roles:
            raise ConfigError(f"no role {role!r} in this job (roles: {', '.join(self.roles)})")
        return role

    def _current(self, role: str, rank: int, incarnation: int) -> Member | None:
        """The member a report is about, or None when it is about a process that is no longer the rank's."""
        member = self.roles[self._known(role)].members.get(rank)
        return member if member is not None and member.incarnation == incarnation else None
