"""The master's calls for jobs of roles and data shards, and how it composes those parts (a part of JobMaster).

``RoleMaster`` (with its sizing) and ``ShardMaster`` decide; these calls take the master's lock, feed them,
and record what they return, as the rest of JobMaster does. Their state rides in the store's parts, so a
restarted master takes the role processes and the shard queues back.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from convoy.control.core import MasterCore
from convoy.control.job import RUNNING, Event
from convoy.control.pool.scheduler import PoolScheduler, Scheduler, Unbounded
from convoy.control.pool.store import PoolStore
from convoy.control.protocol import messages as p
from convoy.control.protocol import roles as rp
from convoy.control.protocol import shards as sp
from convoy.control.roles.groups import CrossGroups
from convoy.control.roles.master import RoleMaster
from convoy.control.roles.preemption import pool_tick
from convoy.control.roles.roles_file import ROLES_PART, load_roles
from convoy.control.roles.views import role_views
from convoy.control.shards.master import STATE_PART, ShardMaster
from convoy.control.status import write_memory
from convoy.control.store import Store, read_part
from convoy.errors import ConfigError, ConflictError
from convoy.sanitize import printable


class RoleCalls:
    """What JobMaster does for roles and shards."""

    def __init__(self, core: MasterCore, resume: bool) -> None:
        """The roles of ``roles.json`` (none: a plain job) and the shard queues, taken back when resumed."""
        self.core, self.job, config = core, core.job, core.config
        roles = load_roles(config.run_dir)
        self.role_master = RoleMaster(self.job, roles, config.max_restarts, self._scheduler(core),
                                      config.preempt_grace_s) if roles else None
        """A job of roles: its processes come from the heartbeats' assignments."""
        self.groups = CrossGroups()
        """Groups across roles (``convoy.join_group``): where each one's rank 0 serves its store."""
        self.group_roles: dict[str, list[str]] = {}
        """Each group's roles, as its first join named them."""
        self.pool_fault = ""
        """Why the pool could not be read at the last tick ("withdrawn": the job ended and left it)."""
        self.taken_back: list[Event] = []
        """What a resumed master took back of the role processes (its events)."""
        if resume and self.role_master is not None and self.job.status == RUNNING:  # before any save replaces it
            saved = read_part(config.run_dir, ROLES_PART)
            self.taken_back = self.role_master.load_state(json.loads(saved)) if saved else self.job.abort(
                "the master restarted and its state holds no roles to take back; run the job again")
        self.shards = ShardMaster.from_state_json(read_part(config.run_dir, STATE_PART) if resume else None)
        """The datasets' shard queues, at the position the state file kept when the master is resumed."""
        if self.role_master is not None:
            self.role_master.exit_hooks.append(self.shards.process_exited)

    @staticmethod
    def _scheduler(core: MasterCore) -> Scheduler:
        """The job's claims in the machine's pool where ``convoy run`` gave one (its nodes all on this machine)."""
        config = core.config
        if not config.pool:
            return Unbounded()
        return PoolScheduler(PoolStore(Path(config.pool)), core.job.job_id, config.priority, str(config.run_dir))

    def pool_tick(self) -> list[Event]:
        """The job's claim synced with the pool (the master's tick, under its lock); withdrawn once the job ended. A
        pool that cannot be read now (another job holds it too long) is tried again at the next tick."""
        roles = self.role_master
        if roles is None or self.pool_fault == "withdrawn":
            return []
        if self.core.ended:
            self.pool_fault = "withdrawn"
            roles.scheduler.close()
            return []
        try:
            events = pool_tick(roles)
        except sqlite3.Error as exc:
            said, self.pool_fault = self.pool_fault, str(exc)
            return [] if said else [Event("pool_unreadable", f"the CPU pool cannot be read now ({exc}); tried again "
                                                             "each tick")]
        self.pool_fault = ""
        return events

    def save_with(self, store: Store) -> None:
        store.parts[STATE_PART] = self.shards.state_json
        role_master = self.role_master
        if role_master is not None:
            store.parts[ROLES_PART] = lambda: json.dumps(role_master.state(), sort_keys=True)

    def role_report(self, report: p.RoleReport) -> p.Ack:
        """A role process started or exited (a job of roles only)."""
        with self.core.changed:
            self.core.nodes.seen(report.node_id, time.monotonic())
            roles = self.required()
            news = roles.orders.news
            events = roles.report(report)
            # a start that decided nothing more is said again by its agent to a restarted master that missed it
            self.core.apply(events, lazy_parts=report.state == "started" and roles.orders.news == news
                            and not self.core.ended)
            self._write_memory()
            return p.Ack()

    def memory_report(self, report: p.MemoryReport) -> p.Ack:
        """A node's free memory and its role processes' peaks; a measuring iteration sizes its role."""
        with self.core.changed:
            self.core.nodes.seen(report.node_id, time.monotonic())
            self.core.apply(self.required().memory(report))
            self._write_memory()
            return p.Ack()

    def _write_memory(self) -> None:
        sizing = self.required().sizing
        if sizing.changed:
            sizing.changed = False
            write_memory(self.core.config.run_dir, sizing.rows(), sizing.margin.margin())

    def scale(self, req: p.ScaleRequest) -> p.Ack:
        """``convoy scale``: run ``req.count`` processes of a role; a count the role cannot take is a 409."""
        with self.core.changed:
            try:
                why = f"asked by {req.author}" if req.author else "asked with convoy scale"
                self.core.apply(self.required().scale(req.role, req.count, why))
            except ConfigError as exc:
                raise ConflictError(str(exc)) from exc
            return p.Ack()

    def scale_from_job(self, req: rp.RoleScale) -> rp.RolesView:
        """``convoy.scale`` from a process of the job (through its agent): the role's new count, and every role's
        counts; a count the role cannot take, or a caller that is no longer the job's, is a 409."""
        with self.core.changed:
            roles = self.required()
            caller = f"{req.caller_role} {req.caller_rank}"
            gone = self.core.stale(roles, req.caller_role, req.caller_rank, req.caller_incarnation)
            if gone:
                raise ConflictError(f"refused convoy.scale({req.role!r}, {req.count}) of {caller}: {gone}")
            why = f"asked by {caller}" + (f": {printable(req.reason)}" if req.reason else "")
            try:
                self.core.apply(roles.scale(req.role, req.count, why))
            except ConfigError as exc:
                raise ConflictError(str(exc)) from exc
            view = self._view(roles)
            row = next(row for row in view.roles if row.name == req.role)
            view.granted = row.wanted
            view.message = (f"role {req.role}: {row.running} running, {row.pending} starting or waiting for room, of "
                            f"{row.wanted}")
            return view

    def roles_view(self, req: rp.RolesQuery) -> rp.RolesView:
        """``convoy.roles()``: every role's counts, as the master holds them now."""
        with self.core.changed:
            roles = self.required()
            gone = self.core.stale(roles, req.caller_role, req.caller_rank, req.caller_incarnation)
            if gone:
                raise ConflictError(f"refused convoy.roles() of {req.caller_role} {req.caller_rank}: {gone}")
            return self._view(roles)

    def group_join(self, req: rp.GroupJoin) -> rp.GroupView:
        """``convoy.join_group``: the group's version, the caller's rank, and its rank 0's store once published."""
        with self.core.changed:
            return self._group(req, req.name, req.roles)

    def group_publish(self, req: rp.GroupPublish) -> rp.GroupView:
        """Rank 0 of a group's current version says where its store is (a 409 for anyone else, or an old version)."""
        with self.core.changed:
            view = self._group(req, req.name, None)
            address = printable(req.address)
            try:
                self.groups.publish(view, req.version, address)
            except ConfigError as exc:
                raise ConflictError(str(exc)) from exc
            view.address = address
            return view

    def _group(self, req: rp.Caller, name: str, names: list[str] | None) -> rp.GroupView:
        roles = self.required()
        gone = self.core.stale(roles, req.caller_role, req.caller_rank, req.caller_incarnation)
        if gone:
            raise ConflictError(f"refused a group call of {req.caller_role} {req.caller_rank}: {gone}")
        names = names if names is not None else self.group_roles.get(name)
        if names is None:
            raise ConflictError(f"no group {name!r} has been joined in this job: join it first")
        try:
            view = self.groups.view(name, names, roles.roles.incarnations(), list(roles.specs),
                                    (req.caller_role, req.caller_rank, req.caller_incarnation))
        except ConfigError as exc:
            raise ConflictError(str(exc)) from exc
        if self.group_roles.setdefault(name, names) != names:
            raise ConflictError(f"group {name!r} is the group of roles {self.group_roles[name]}, not {names}: give "
                                "another name")
        return view

    @staticmethod
    def _view(roles: RoleMaster) -> rp.RolesView:
        rows = role_views(tuple(roles.specs.values()), roles.roles.state())
        return rp.RolesView(roles=[rp.RoleView(**row) for row in rows])

    def shard_call(self, req: sp.ShardWorker) -> Any:
        """A worker process's shard call (declare, request, progress, done), forwarded by its agent; a call of a
        process that is no longer the job's (restarted, stopped, of an ended round) is a 409."""
        with self.core.changed:
            roles = self.role_master
            gone = self.core.stale(roles, req.role, req.rank, req.incarnation)
            if gone:
                raise ConflictError(f"refused a shard call of worker {req.worker_id}: {gone}")
            answer = self.shards.call(req, None if roles else self.job.round_id)
            self.core.apply(answer.events)
            if answer.reply is None:
                raise ConflictError(answer.refusal)
            return answer.reply

    def required(self) -> RoleMaster:
        """The job's roles; a call that needs them in a job without roles is a 409 that says how to give some."""
        if self.role_master is None:
            raise ConflictError(f"job {self.job.job_id} declares no roles: give it some with --ps, --workers, --role "
                                "or [roles.NAME] in a job file")
        return self.role_master
