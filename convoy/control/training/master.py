"""The master's side of the training manager: the ranks' status, the config's versions, and when each version
takes effect. Pure (JobMaster holds its lock around each call, records the events, writes the status rows
and persists ``state()``); it tells the master when a round must restart to apply a restart field.

A change takes effect at one global step for every rank: the first step boundary every rank can still reach,
estimated from each rank's last reported step and step time plus the time a push takes to reach them; in a job
of roles, each role's own step (an actor's episodes and a learner's updates are not the same count).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Mapping

from convoy.control.job import Event
from convoy.control.protocol import training as tp
from convoy.control.training.versions import (ACTIVE, CHANGE, HOT, PENDING, RESTART, REVERT, REVERTED, SUPERSEDED,
                                              ConfigHistory, FieldSpec, Schema, Version)
from convoy.control.training.proposals import APPLIED, JobProposals
from convoy.errors import ConfigError, ConflictError

STATE_PART = "train_config"
PROPOSALS_PART = "train_proposals"
PUSH_S = 0.3
"""How long a new version may take to reach every rank (the agents' long poll, their file, the next step)."""
TRUST_STEPS = 10
"""A version every rank ran this many steps with is trusted: a later failure is not reverted to its predecessor."""
RESTART_WAIT_S = 30.0
"""How long after a restart version's step the master waits for every rank to park before restarting anyway."""


@dataclass
class TaskState:
    """What the master knows of one rank's progress."""

    role: str
    incarnation: int
    step: int = -1
    point_time: float = 0.0
    sent_at: float = 0.0
    received: float = 0.0
    step_time_s: float = 0.0
    parked: int | None = None
    stale: bool = False
    """Of an ended round or incarnation: the process now starting in its place resumes at about ``step``."""

    def estimated_step(self, now: float) -> float:
        """The step this rank is at ``now`` (master's monotonic clock), extrapolated from its last report (not
        past it while its successor of a new round has not reported: that one sends its first point at once)."""
        if self.step < 0:
            return 0.0
        if self.step_time_s <= 0 or self.stale:
            return float(self.step)
        since = max(0.0, self.sent_at - self.point_time) + max(0.0, now - self.received)
        return self.step + since / self.step_time_s


@dataclass
class Rows:
    """Status rows to write: ``(task, role, rank, step, time, loss, step_time_s, samples_per_s, memory_bytes,
    grad_norm, metrics_json)``."""

    rows: list[tuple[Any, ...]] = field(default_factory=list)


class TrainMaster:
    """One job's training status, config versions and proposals, fed by the master's calls."""

    def __init__(self, history: ConfigHistory | None = None, proposals: JobProposals | None = None,
                 checkpoints: Callable[[], list[int]] = list) -> None:
        """``checkpoints``: the steps of the job's persistent checkpoints (what a rollback can go back to)."""
        self.history = history or ConfigHistory()
        self.proposals = proposals or JobProposals()
        self.checkpoints = checkpoints
        self.rollback_round: tuple[int, int] | None = None
        """(round, step): the round a rollback opened restores at most that step."""
        self.tasks: dict[str, TaskState] = {}
        """The processes the job runs now that reported (``role:rank``); ``retain`` forgets those that left."""
        self.job_of_roles = False
        """Set by the master for a job of roles: a restart version restarts the processes of the roles that
        declared the config (no round restarts them), and a rollback is refused."""
        self.declared_roles: set[str] = set()
        self.restart_due: str | None = None
        """Set when a restart version should restart the round now (the reason); the master clears it."""
        self._restart_asked: float | None = None

    # --- calls of the ranks ---

    def declare(self, req: tp.ConfigDeclare) -> tuple[tp.ConfigState, list[Event]]:
        schema = Schema(tuple(FieldSpec(d.name, d.type, d.kind, d.default, d.minimum, d.maximum, tuple(d.choices),
                                        d.doc) for d in req.fields), req.restartable)
        first = self.history.declare(schema, req.task_id)
        self.declared_roles.add(req.role)
        events = []
        if first is not None:
            hot = sum(spec.kind == HOT for spec in schema.fields)
            events.append(Event("config_declared", f"training config declared by {req.task_id}: {len(schema.fields)} "
                                                   f"fields ({hot} hot); version 1: {_words(first.values)}"))
        return self.config_state(), events

    def report(self, req: tp.StatusReport, now: float, expected: int) -> tuple[tp.StatusAck, list[Event], Rows]:
        """Take a rank's points and what it did with the config; ``expected``: ranks the job runs now."""
        task = self.tasks.get(req.task_id)
        if task is None or task.incarnation != req.incarnation:
            task = self.tasks[req.task_id] = TaskState(req.role, req.incarnation)
        rows = Rows()
        for point in req.points:
            self._take_point(task, point)
            rows.rows.append(_row(req, point))
        if req.points:
            task.sent_at, task.received = req.sent_at, now
        events = [Event("status_dropped", f"{req.task_id} could not send {req.dropped} status points (its agent "
                                          "or the master was slow)")] if req.dropped else []
        for number, step in req.switched.items():
            events += self._switched(req.task_id, int(number), step, expected)
        if req.parked is not None:
            task.parked = req.parked
            events += self._check_parked(now, expected)
        if req.points:  # a script that reports without a training config is judged too (proposals of evidence)
            events += self._judge(req, now)
        return tp.StatusAck(version=self.history.current.number if self.history.current else 0), events, rows

    def _take_point(self, task: TaskState, point: tp.StatusPoint) -> None:
        if point.step <= task.step:
            return
        if point.step_time_s:
            task.step_time_s = point.step_time_s if task.step_time_s <= 0 else 0.8 * task.step_time_s + \
                0.2 * point.step_time_s
        elif task.step >= 0 and point.time > task.point_time:
            task.step_time_s = (point.time - task.point_time) / (point.step - task.step)
        task.step, task.point_time = point.step, point.time

    def _switched(self, task_id: str, number: int, step: int, expected: int) -> list[Event]:
        version = self.history.number(number)
        if version is None or task_id in version.switched:
            return []
        version.switched[task_id] = step
        # a rank that left the job (a smaller round, a role scaled down) switched, or not, for nothing
        switched = {task: at for task, at in version.switched.items() if task in self.tasks}
        if len(switched) < expected:
            return []
        if version.status == PENDING:
            version.status = ACTIVE
            for older in self.history.versions:
                if older.number < number and older.status == ACTIVE:
                    older.status = SUPERSEDED
        took = time.time() - version.created_at
        if all(at == version.step_for(self.tasks[task].role) for task, at in switched.items()):
            return [Event("config_applied", f"config version {number} ({_words(version.changed)}) runs on all "
                                            f"{len(switched)} ranks from step {_steps_text(version)}, {took:.2f} s "
                                            "after it was set", console=True)]
        return [Event("config_split", f"config version {number} was planned for step {_steps_text(version)} but ranks "
                                      f"switched at steps {sorted(set(switched.values()))}: {switched}", console=True)]

    def _judge(self, req: tp.StatusReport, now: float) -> list[Event]:
        """The rules over the new points: each new proposal is an event, and applied when its rule is opted in."""
        events = []
        for kept in self.proposals.judge(req.task_id, req.points, self.history, self.checkpoints()):
            roll = f"; roll back to step {kept.rollback_to}" if kept.rollback_to is not None else ""
            suggested = _words(kept.values) or "no change suggested"
            events.append(Event("proposal", f"proposal {kept.id} ({kept.rule} at step {kept.step}): {kept.evidence}"
                                            f" -> {suggested}{roll}", console=True))
            if kept.auto and (kept.values or kept.rollback_to is not None):
                try:
                    events += self.apply_proposal(kept.id, "convoy (auto-apply)", now)[1]
                except (ConflictError, ConfigError) as exc:
                    events.append(Event("proposal_not_applied", f"proposal {kept.id} was not applied: {exc}"))
        return events

    def apply_proposal(self, number: int, author: str, now: float) -> tuple[Version, list[Event]]:
        """A proposal's values from the first step every rank can still reach, or, with a rollback, from the step
        after the checkpoint it rolls back to (by a restart)."""
        kept = self.proposals.find(number)
        if kept.rollback_to is not None and self.job_of_roles:
            raise ConflictError(f"proposal {number} rolls back to step {kept.rollback_to}, and a job of roles cannot "
                                "roll back (each process restores its own newest snapshot); set its values with "
                                "convoy config set instead")
        if kept.rollback_to is not None:
            version, events = self.proposals.rollback(kept, self.history, author)
            self.restart_due = f"config version {version.number} rolls back to step {kept.rollback_to}"
        elif kept.values:
            version, events = self.set(tp.ConfigSet(values=kept.values, author=author,
                                                    reason=f"proposal {kept.id} ({kept.rule})"), now)
        else:
            raise ConflictError(f"proposal {number} ({kept.rule}) is evidence only: it suggests no change; set the "
                                "config yourself, or dismiss it")
        kept.status, kept.version, kept.decided_by = APPLIED, version.number, author
        return version, events

    # --- calls of users (and of the rules) ---

    def plan_steps(self, now: float) -> dict[str, int]:
        """Per role: the first step boundary each of its ranks can still reach once a version pushed ``now``
        arrives (a plain job's one role is ``default``)."""
        by_role: dict[str, list[TaskState]] = {}
        for task in self._configured():
            if task.step >= 0:
                by_role.setdefault(task.role, []).append(task)
        return {role: _reach(tasks, now) for role, tasks in sorted(by_role.items())}

    def set(self, req: tp.ConfigSet, now: float, at_step: int | None = None,
            kind: str = CHANGE) -> tuple[Version, list[Event]]:
        """A target config: a ConfigError (bad field or value) or ConflictError (not now) changes nothing.
        ``at_step``: the first step of every role (else each role's earliest)."""
        changed, apply = self.history.prepare(dict(req.values))
        plans = self.plan_steps(now)
        if at_step is not None:
            _check_reach(at_step, plans)
        version = self.history.add(changed, apply, max(plans.values(), default=0) if at_step is None else at_step,
                                   req.author, req.reason, kind,
                                   role_steps=plans if at_step is None and len(plans) > 1 else {})
        how = ("by a restart of its roles" if self.job_of_roles else "by a restart of the round") \
            if apply == RESTART else "in place"
        events = [Event("config_set", f"config version {version.number} by {version.author}: "
                                      f"{_words(changed)}, applied {how} from step {_steps_text(version)}"
                                      + (f" ({req.reason})" if req.reason else ""), console=True)]
        if apply == RESTART:
            self._restart_asked = now
            for task in self.tasks.values():
                task.parked = None
        return version, events

    # --- what the master tells it ---

    def tick(self, now: float, expected: int) -> list[Event]:
        return self._check_parked(now, expected)

    def _check_parked(self, now: float, expected: int) -> list[Event]:
        pending = [v for v in self.history.versions if v.status == PENDING and v.apply == RESTART]
        if not pending or self._restart_asked is None or self.restart_due is not None:
            return []
        version = pending[0]
        parked = [t for t in self.tasks.values() if t.parked is not None]
        all_parked = len(parked) >= expected > 0
        overdue = now - self._restart_asked > RESTART_WAIT_S + PUSH_S
        if not (all_parked or overdue):
            return []
        why = "every rank finished the step before it" if all_parked else \
            f"{len(parked)} of {expected} ranks parked within {RESTART_WAIT_S:.0f} s"
        self.restart_due = f"config version {version.number} ({_words(version.changed)}): {why}"
        self._restart_asked = None
        return []

    def round_started(self, round_id: int) -> None:
        """A new round of a plain job: the ranks start again (a pending restart version takes effect as they
        resume)."""
        if self.proposals.rollback_step is not None:
            self.rollback_round = (round_id, self.proposals.rollback_step)
            self.proposals.rollback_step = None
        self._resumed(self.tasks.values())

    def restart_roles(self) -> list[str]:
        """The roles a restart version restarts in a job of roles: those whose processes declared the config
        (they hold its values; a role that only reports its status does not)."""
        return sorted(self.declared_roles)

    def configured_ranks(self) -> int:
        """How many reporting processes run with the config: those that switch to a version, and park for a
        restart one."""
        return len(self._configured())

    def _configured(self) -> list[TaskState]:
        """The reporting processes of the roles that declared the config (all, from a state that did not say)."""
        return [task for task in self.tasks.values() if not self.declared_roles or task.role in self.declared_roles]

    def roles_restarted(self, roles: Collection[str]) -> None:
        """The processes of ``roles`` start again as new incarnations (a restart version takes effect as they
        resume)."""
        self._resumed([task for task in self.tasks.values() if task.role in roles])

    def _resumed(self, restarted: Iterable[TaskState]) -> None:
        """Until a restarted rank reports, it is taken to be where it resumes: the restart's gap is not steps it
        ran (counted, the next version's step would be planned seconds too late)."""
        self.restart_due = None
        for task in restarted:
            task.stale = True
        for version in self.history.versions:  # its processes resume with it: a next change may come
            if version.status == PENDING and version.apply == RESTART:
                version.status = ACTIVE
        for task in self.tasks.values():
            task.parked = None

    def retain(self, running: Mapping[str, int]) -> None:
        """The job's membership changed: ``running`` maps each process it runs now (``role:rank``) to its
        incarnation. A rank that left (a smaller round, a role scaled down, a finished process) is forgotten: its
        frozen step would hold back every trust and plan. One running as a new incarnation is taken to be where
        it resumes until it reports."""
        for task_id, task in list(self.tasks.items()):
            incarnation = running.get(task_id)
            if incarnation is None:
                del self.tasks[task_id]
            elif incarnation != task.incarnation:
                task.stale, task.parked = True, None

    def trust(self) -> None:
        """Versions every rank ran TRUST_STEPS steps with (each counted in its role's steps) are no longer
        reverted on a failure."""
        running = [t for t in self._configured() if t.step >= 0]
        if not running:
            return
        for version in self.history.versions:
            if not version.trusted and version.status != REVERTED and \
                    all(t.step >= version.step_for(t.role) + TRUST_STEPS for t in running):
                version.trusted = True
                if version.status == PENDING:
                    version.status = ACTIVE

    def worker_failed(self, now: float) -> list[Event]:
        """A rank failed: a change that was in effect for fewer than TRUST_STEPS steps is reverted."""
        self.trust()
        current = self.history.current
        if current is None or current.trusted or current.kind != CHANGE or current.number == 1:
            return []
        reached = any(t.estimated_step(now) + 1 >= current.step_for(t.role) for t in self._configured()) or \
            current.apply == RESTART and current.status != PENDING
        if not reached and not current.switched:
            return []
        previous = self.history.before(current)
        assert previous is not None
        back = {name: previous.values[name] for name in current.changed}
        current.status = REVERTED
        revert = self.history.add(back, current.apply, current.at_step, "convoy",
                                  f"the workers failed within {TRUST_STEPS} steps of version {current.number}",
                                  REVERT, role_steps=current.role_steps)
        revert.status = ACTIVE if current.apply == HOT else PENDING
        return [Event("config_reverted", f"the workers failed after config version {current.number} "
                                         f"({_words(current.changed)}) took effect: version {revert.number} puts "
                                         f"back {_words(back)}", console=True)]

    def config_state(self) -> tp.ConfigState:
        current = self.history.current
        return tp.ConfigState(version=current.number if current else 0,
                              versions=[tp.version_info(v) for v in self.history.versions if v.status != REVERTED])

    def restore_at_most(self, round_id: int) -> int | None:
        """The step a round's workers restore at most (the round a rollback opened), else None."""
        return self.rollback_round[1] if self.rollback_round and self.rollback_round[0] == round_id else None

    def state_json(self) -> dict[str, Any]:
        return self.history.state() | {"rollback_round": self.rollback_round,
                                       "declared_roles": sorted(self.declared_roles)}

    @classmethod
    def from_state(cls, data: dict[str, Any] | None, overrides: dict[str, str], auto_apply: tuple[str, ...] = (),
                   proposals: list[dict[str, Any]] | None = None,
                   checkpoints: Callable[[], list[int]] = list) -> TrainMaster:
        master = cls(ConfigHistory.from_state(data) if data else ConfigHistory(overrides),
                     JobProposals(auto_apply, proposals), checkpoints)
        if data and data.get("rollback_round"):
            master.rollback_round = tuple(data["rollback_round"])  # type: ignore[assignment]
        master.declared_roles = set(data.get("declared_roles", ())) if data else set()
        return master


def _reach(tasks: list[TaskState], now: float) -> int:
    """The first step boundary every one of ``tasks`` (ranks that count the same steps) can still reach once a
    version pushed ``now`` arrives."""
    fastest = min((t.step_time_s for t in tasks if t.step_time_s > 0), default=0.0)
    ahead = math.ceil(PUSH_S / fastest) if fastest > 0 else 1
    return int(max(t.estimated_step(now) for t in tasks)) + max(ahead, 1) + 1


def _check_reach(at_step: int, plans: dict[str, int]) -> None:
    """A ConflictError when a role's ranks may reach ``at_step`` before a version pushed now does."""
    for role, earliest in plans.items():
        if at_step < earliest:
            whose = "every rank" if len(plans) == 1 else f"every rank of role {role}"
            raise ConflictError(f"step {at_step} is too soon: the ranks may reach it before the change does; the "
                                f"earliest step {whose} can still switch at is {earliest}")


def _steps_text(version: Version) -> str:
    """``40``, or where roles count steps of their own, ``1031 of actor, 12 of learner``."""
    if not version.role_steps:
        return str(version.at_step)
    return ", ".join(f"{step} of {role}" for role, step in sorted(version.role_steps.items()))


def _row(req: tp.StatusReport, point: tp.StatusPoint) -> tuple[Any, ...]:
    return (req.task_id, req.role, req.rank, point.step, point.time, _finite(point.loss), point.step_time_s,
            point.samples_per_s, point.memory_bytes, _finite(point.grad_norm),
            json.dumps(point.metrics) if point.metrics else None)


def _finite(value: float | None) -> float | str | None:
    """SQLite keeps NaN as NULL: a NaN or inf loss is kept as its text, so the status shows it."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


def _words(values: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in values.items())
