"""The master's calls of the training manager (a part of JobMaster): the ranks' status and the live config.

``TrainMaster`` decides; these calls take the master's lock, feed it, record its events, write the status
rows, tell it who runs now when the membership changes, and apply a restart field: by a new round (a plain job)
or by restarting the processes of the roles that declared the config (a job of roles, whose rounds restart no
process). The config's versions ride in the store's parts, so a restarted master keeps them.
"""

from __future__ import annotations

import json
import time
from typing import Any

from convoy.control.core import MasterCore
from convoy.control.job import Event
from convoy.control.protocol import training as tp
from convoy.control.roles.master import RoleMaster
from convoy.control.roles.members import FINISHED
from convoy.control.shards.master import PLAIN_ROLE
from convoy.control.store import Store, read_part
from convoy.control.training.master import PROPOSALS_PART, STATE_PART, TrainMaster
from convoy.control.training.proposals import checkpoint_steps
from convoy.control.training.status_store import StatusStore, latest_by_task, read_metrics
from convoy.errors import ConfigError, ConflictError

MAX_METRICS_LIMIT = 10_000


class TrainCalls:
    """What JobMaster does for training status and config (``role_master``: the job's roles, None in a plain job)."""

    def __init__(self, core: MasterCore, role_master: RoleMaster | None, resume: bool) -> None:
        self.core, self.job, self.role_master, config = core, core.job, role_master, core.config
        saved = read_part(config.run_dir, STATE_PART) if resume else None
        proposals = read_part(config.run_dir, PROPOSALS_PART) if resume else None
        run_dir = config.run_dir
        self.train = TrainMaster.from_state(json.loads(saved) if saved else None, dict(config.train_overrides),
                                            config.auto_apply, json.loads(proposals) if proposals else None,
                                            lambda: checkpoint_steps(run_dir))
        self.train.job_of_roles = self.role_master is not None
        self._train_round = self.job.round_id
        self._train_members = -1
        """The round whose membership the training master was last told (a plain job)."""
        self._train_processes_changed = False
        """A role process exited since the training master was last told who runs (a job of roles)."""
        if self.role_master is not None:
            self.role_master.exit_hooks.append(self._process_exited)

    def save_with(self, store: Store) -> None:
        store.parts[STATE_PART] = lambda: json.dumps(self.train.state_json(), sort_keys=True)
        store.parts[PROPOSALS_PART] = lambda: json.dumps(self.train.proposals.state(), sort_keys=True)
        self.status_store = StatusStore(self.core.config.run_dir)

    @property
    def config_version(self) -> int:
        current = self.train.history.current
        return current.number if current else 0

    def train_declare(self, req: tp.ConfigDeclare) -> tp.ConfigState:
        with self.core.changed:
            self._check_current(req, "declare a training config")
            state, events = self.train.declare(req)
            self.core.apply(events)
            return state

    def train_report(self, req: tp.StatusReport) -> tp.StatusAck:
        """A rank's status points; a process of an ended round (or job) is refused and writes nothing."""
        with self.core.changed:
            self._check_current(req, "report training status")
            now = time.monotonic()
            ack, events, rows = self.train.report(req, now, self._expected_ranks())
            self.status_store.add(rows.rows)
            self.core.apply(events + self.advance(now))
            return ack

    def config_set(self, req: tp.ConfigSet) -> tp.VersionInfo:
        """``PUT /v1/config`` (``convoy config set``): a ConfigError is a 400 and a ConflictError a 409 that name
        the field; either changes nothing on any rank."""
        with self.core.changed:
            if self.core.ended:
                raise ConflictError(f"job {self.job.job_id} has ended ({self.job.status}): its config cannot change")
            self.membership_seen()  # a process that exited since the last tick plans no step
            version, events = self.train.set(req, time.monotonic(), req.at_step)
            self.core.apply(events)
            return tp.version_info(version)

    def config_get(self) -> dict[str, Any]:
        with self.core.changed:
            history = self.train.history
            return {"version": self.config_version, "schema": history.schema.to_json() if history.schema else None,
                    "overrides": history.overrides, "versions": [v.public() for v in history.versions],
                    "proposals": self.train.proposals.state(), "job_status": self.job.status}

    def proposal_action(self, req: tp.ProposalAction) -> tp.VersionInfo:
        """Apply a proposal (its version, as ``config set`` gives it) or dismiss it (an empty version, number 0)."""
        with self.core.changed:
            if self.core.ended:
                raise ConflictError(f"job {self.job.job_id} has ended ({self.job.status}): its config cannot change")
            if req.action == "dismiss":
                self.core.apply(self.train.proposals.dismiss(req.proposal, req.author))
                return tp.VersionInfo(number=0, values={}, kind="", apply="hot", at_step=0)
            version, events = self.train.apply_proposal(req.proposal, req.author, time.monotonic())
            self.core.apply(events + self.advance(time.monotonic()))
            return tp.version_info(version)

    def metrics(self, query: dict[str, str]) -> dict[str, Any]:
        """``GET /v1/metrics``: status rows (``task``, ``since`` a step, ``limit``), and each task's newest."""
        try:
            since = int(query.get("since", "-1"))
            limit = int(query.get("limit", "1000"))
        except ValueError as exc:
            raise ConfigError(f"since and limit are whole numbers: {exc}") from None
        if not 1 <= limit <= MAX_METRICS_LIMIT:
            raise ConfigError(f"limit must be 1..{MAX_METRICS_LIMIT} (got {limit})")
        task = query.get("task", "")
        unknown = sorted(set(query) - {"task", "since", "limit"})
        if unknown:
            raise ConfigError(f"unknown query parameter(s) {unknown}: give task, since or limit")
        run_dir = self.core.config.run_dir
        return {"points": read_metrics(run_dir, task, since, limit), "latest": latest_by_task(run_dir),
                "dropped": self.status_store.dropped}

    def _check_current(self, req: tp.Task, what: str) -> None:
        gone = self.core.stale(self.role_master, req.role, req.rank, req.incarnation)
        if gone:
            raise ConflictError(f"refused: {req.task_id} may not {what}: it {gone}")

    def _expected_ranks(self) -> int:
        """The ranks that must switch: the round's world (plain workers), or the processes of the roles that
        declared the config that report (roles)."""
        if self.role_master is None:
            membership = self.job.membership
            return membership.world_size if membership is not None else 0
        return self.train.configured_ranks()

    def advance(self, now: float) -> list[Event]:
        """Apply the restart version that waits (a round, or the roles' processes restarted); tell the manager
        when a new round has begun and who runs now."""
        self.round_seen()
        self.membership_seen()
        events = self.train.tick(now, self._expected_ranks())
        if self.train.restart_due is not None:
            events += self._restart(self.train.restart_due, now)
        return events

    def _restart(self, reason: str, now: float) -> list[Event]:
        if self.role_master is None:
            self.train.restart_due = None
            return self.job.reconfigure(reason, now)
        roles = self.train.restart_roles()
        events = [Event("reconfigure", f"{reason}: the processes of role(s) {', '.join(roles)} start again to apply "
                                       "it (not a restart)", console=True)]
        events += self.role_master.restart_roles(roles, reason)
        self.train.roles_restarted(roles)
        return events

    def round_seen(self) -> None:
        """Tell the training master once that a new round of a plain job has begun: at the next tick, or sooner,
        when the first member asks for the round's info (which carries the step a rollback restores at most).
        A job of roles' rounds only gather its nodes: its processes go on through them."""
        if self.job.round_id != self._train_round:
            self._train_round = self.job.round_id
            if self.role_master is None:
                self.train.round_started(self.job.round_id)

    def membership_seen(self) -> None:
        """Tell the training master who runs now once that changed: the ranks of a plain job's newly closed round,
        or the current process of each rank of a job of roles after one exited."""
        membership = self.job.membership
        if self.role_master is None and membership is not None and membership.round_id != self._train_members:
            self._train_members = membership.round_id
            self.train.retain({f"{PLAIN_ROLE}:{rank}": membership.round_id for rank in range(membership.world_size)})
        elif self.role_master is not None and self._train_processes_changed:
            self._train_processes_changed = False
            self.train.retain({f"{name}:{rank}": member.incarnation
                               for name, state in self.role_master.roles.roles.items()
                               for rank, member in state.members.items() if member.state != FINISHED})

    def _process_exited(self, role: str, rank: int, incarnation: int, how: str) -> list[Event]:
        """A role process exited (finished, failed, stopped, lost with its node): who runs changed."""
        self._train_processes_changed = True
        return []

    def worker_failed(self, now: float) -> list[Event]:
        """A worker failed: revert a config that was not trusted yet (before the restart reads it)."""
        return self.train.worker_failed(now)
