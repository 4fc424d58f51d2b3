"""A job's roles as a pure state machine: who holds which rank of each role, what a failure or a scale
request leads to, and the events of each change.

Every call returns the decisions the master carries out (start or stop one process, a new round for the
job, the job's failure) and the events to record; no I/O happens here. Role ranks are stable: a restarted
process keeps its rank, scaling down stops the highest ranks, scaling up fills the lowest free ones.
Model: ``control/job.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from convoy.control.job import Event
from convoy.control.roles.flat import flat
from convoy.errors import ConfigError
from convoy.roles_config import FIXED_COUNT, REPLACE, RESTART_JOB, RESTART_ROLE, RESTORE_ONE, RoleSpec

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
    anywhere: bool = False
    """Placed on any node with room, not back on the rank's last node (a replacement)."""


@dataclass(frozen=True)
class Stop:
    """Stop the process of ``role`` rank ``rank`` (scaled down, or a service no one needs any more)."""

    role: str
    rank: int
    reason: str = ""
    notice: bool = False
    """Preempted: the process is told first and given a grace to finish its unit of work before SIGTERM."""


@dataclass(frozen=True)
class RestartJob:
    """Open a new round for the whole job (the failed role's policy asks for it)."""

    reason: str


@dataclass(frozen=True)
class RestartRole:
    """Every process of ``role`` starts again together, as a new round of the role (its group re-forms)."""

    role: str
    reason: str
    notice: bool = False
    """Told first, as a preempted process is (a group that forms again without a preempted member): its members
    leave together at the end of a step, not at SIGTERM in the middle of one."""


@dataclass(frozen=True)
class FailJob:
    reason: str


Decision = Start | Stop | RestartJob | RestartRole | FailJob


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
    replaced_at: list[float] = field(default_factory=list)
    """When each process of a ``replace`` role was replaced, within the last ``replacement_window_s``."""
    replacements: int = 0
    """Processes replaced in all (status)."""
    group_round: int = 0
    """The round of a role group: grows each time its members start again together (0: never started)."""
    preempted: int = 0
    """Processes given back to jobs of higher priority (status)."""
    grow_to: int = 0
    """The count the role had before it was preempted: it grows back to it as the pool has room (0: none)."""

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
        self.services = tuple(spec.name for spec in specs if spec.service)
        """Roles that serve the others: they run until every other role has finished, then they are stopped."""
        self.failed_reason = ""

    def start(self) -> tuple[list[Decision], list[Event]]:
        """The processes to start first: every role at its count; ``auto`` roles wait for ``size``."""
        decisions: list[Decision] = []
        events = []
        for name, state in self.roles.items():
            decisions += self._fill(state, "the job starts")
            if state.spec.group and state.members:
                state.group_round = 1
            counted = "auto: sized once measured" if state.spec.count.auto else str(state.target)
            kind = ", a service" if state.spec.service else ", one process group" if state.spec.group else ""
            events.append(Event("role_declared", f"role {name}: {counted} process(es){kind}, on failure "
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
            for name in self.services:
                state = self.roles.get(name)
                for member_rank, member in sorted(state.members.items()) if state else ():
                    if member.state != FINISHED:
                        decisions.append(Stop(name, member_rank, "every other role has finished"))
        return decisions, events

    def failed(self, role: str, rank: int, incarnation: int, why: str,
               now: float = 0.0) -> tuple[list[Decision], list[Event]]:
        """A process failed: its role's policy says what follows, within the role's restart budget (a ``replace``
        role: within its replacements per window, at ``now``). The exit of a process that was stopped on purpose
        (scaled away) or replaced already is ignored."""
        state = self.roles[self._known(role)]
        member = self._current(role, rank, incarnation)
        if member is None or self.failed_reason:
            return [], []
        policy = state.spec.failure_policy
        if policy == REPLACE:
            return self._replace(state, rank, member, why, now)
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
        if policy == RESTART_ROLE:
            reason = (f"{role} {rank} failed ({why}); every process of role {role} starts again together (restart "
                      f"{state.restarts} of {self.max_restarts} for role {role})")
            return [RestartRole(role, reason)], [Event("role_failed", reason, console=True)]
        restore = policy == RESTORE_ONE
        reason = (f"{role} {rank} failed ({why}); restarting only it" + (" with its state" if restore else "")
                  + f" (restart {state.restarts} of {self.max_restarts} for role {role})")
        return [Start(role, rank, restore, reason, member.incarnation)], [Event("role_failed", reason, console=True)]

    def _replace(self, state: RoleState, rank: int, member: Member, why: str,
                 now: float) -> tuple[list[Decision], list[Event]]:
        """An expendable process failed: another takes its rank on any node with room, spending no restart, unless
        the role has replaced ``max_replacements`` within its window already (a failure loop: the job fails)."""
        spec, role = state.spec, state.spec.name
        state.replaced_at = [at for at in state.replaced_at if now - at < spec.replacement_window_s]
        if len(state.replaced_at) >= spec.max_replacements:
            self.failed_reason = (f"{role} {rank} failed ({why}) and role {role} has replaced {len(state.replaced_at)} "
                                  f"process(es) within {spec.replacement_window_s:g} s (its max_replacements): a "
                                  "failure loop, not bad luck")
            return [FailJob(self.failed_reason)], [Event("job_failed", self.failed_reason, console=True)]
        state.replaced_at.append(now)
        state.replacements += 1
        member.state, member.address, member.incarnation = STARTING, "", state.launch()
        reason = (f"{role} {rank} failed ({why}); replaced on any node with room, no restart spent "
                  f"({len(state.replaced_at)} of {spec.max_replacements} within {spec.replacement_window_s:g} s)")
        return [Start(role, rank, False, reason, member.incarnation, anywhere=True)], \
            [Event("role_replaced", reason, console=True)]

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
        if state.spec.group:
            return [RestartRole(role, f"{role} {rank} {why}; its group forms again (no restart spent)")]
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
            if state.spec.group:
                state.group_round += 1
            for rank, member in sorted(state.members.items()):
                member.incarnation, member.state, member.address = state.launch(), STARTING, ""
                starts.append(Start(name, rank, state.spec.failure_policy == RESTORE_ONE, reason, member.incarnation))
        return starts

    def restarts_spent(self) -> int:
        """Restarts the job's roles have spent in all (what the job's end reports)."""
        return sum(state.restarts for state in self.roles.values())

    def scale(self, role: str, count: int, why: str = "") -> tuple[list[Decision], list[Event]]:
        """Run ``count`` processes of ``role``: start the lowest free ranks or stop the highest ones; ``why`` (who
        asked, and their reason) goes into the event."""
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
        filled = self._fill(state, f"role {role} scaled to {count}")
        if state.spec.group and before != count and state.members:  # a world of the new size: every member anew
            decisions.append(RestartRole(role, f"role {role} scaled to {count}: its group forms again"))
        else:
            decisions += filled
        because = f" ({why})" if why else ""
        return decisions, [Event("role_scaled", f"role {role}: {before} -> {count} process(es){because}", console=True)]

    def preempt(self, role: str, why: str) -> tuple[list[Decision], list[Event]]:
        """Give back the role's highest rank to a job of higher priority: the role runs one fewer (not below its MIN),
        and grows back to its count before the preemption once there is room again. The rank is told first and has
        the preempt grace to finish its unit of work; a group's other members form their group again at the smaller
        size (from their snapshots), as when it is scaled down."""
        state = self.roles[self._known(role)]
        if state.target <= state.spec.count.minimum or not state.members:
            return [], []
        rank = max(state.members)
        state.grow_to = max(state.grow_to, state.target)
        state.target -= 1
        state.preempted += 1
        del state.members[rank]
        reason = f"{role} {rank} preempted: {why}"
        decisions: list[Decision] = [Stop(role, rank, reason, notice=True)]
        if state.spec.group and state.members:
            decisions.append(RestartRole(role, f"{reason}; its group forms again with {state.target} process(es)",
                                         notice=True))
        return decisions, [Event("role_preempted", reason, console=True)]

    def grow_back(self, role: str) -> tuple[list[Decision], list[Event]]:
        """One more process of a preempted role, toward its count before the preemption."""
        state = self.roles[self._known(role)]
        if state.grow_to <= state.target:
            state.grow_to = 0
            return [], []
        decisions, events = self.scale(role, state.target + 1, "grows back: the pool has room again")
        if state.target >= state.grow_to:
            state.grow_to = 0
        return decisions, events

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
        if self.roles[role].spec.group:
            return [RestartRole(role, reason)], [Event("role_relaunched", reason, console=True)]
        member.state, member.address = STARTING, ""
        member.incarnation = self.roles[role].launch()
        return [Start(role, rank, False, reason, member.incarnation)], [Event("role_relaunched", reason, console=True)]

    def done(self) -> bool:
        """Every process of every non-service role has finished (and each such role has some)."""
        working = [state for name, state in self.roles.items() if name not in self.services]
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

    def group_address(self, role: str) -> str:
        """Where a role group's rank 0 serves its rendezvous (its address, once its current process has said it
        runs); ``"-"`` for a role that forms no group (nothing to wait for)."""
        state = self.roles[self._known(role)]
        if not state.spec.group:
            return "-"
        first = state.members.get(0)
        return first.address if first is not None and first.state == RUNNING else ""

    def group_round(self, role: str) -> int:
        """The round of a role group (0: the role forms no group)."""
        state = self.roles[self._known(role)]
        return state.group_round if state.spec.group else 0

    def state(self) -> dict[str, Any]:
        """What a restarted master needs to take the roles back (JSON-ready; the specs come from roles.json)."""
        return {"failed_reason": self.failed_reason, "roles": {
            name: {"target": state.target, "restarts": state.restarts, "launches": state.launches,
                   "replaced_at": state.replaced_at, "replacements": state.replacements,
                   "group_round": state.group_round, "preempted": state.preempted, "grow_to": state.grow_to,
                   "members": {str(rank): flat(member) for rank, member in state.members.items()}}
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
            state.replaced_at, state.replacements = list(entry["replaced_at"]), entry["replacements"]
            state.group_round = entry["group_round"]
            state.preempted, state.grow_to = entry["preempted"], entry["grow_to"]
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
