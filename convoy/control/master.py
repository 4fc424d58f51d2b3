"""JobMaster: composes the job state machine, node registry, SQLite store and HTTP API.

It holds no logic of its own: each request takes the lock, feeds the pure state machines,
then records the events, prints the console ones, and wakes the long polls.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from convoy.config import MasterConfig
from convoy.control.api import ApiServer
from convoy.control.core import MasterCore
from convoy.control.dashboard.actions import in_process
from convoy.control.dashboard.server import Dashboard, JobEntry
from convoy.control.job import RUNNING, Event, Job
from convoy.control.limits import server_tls
from convoy.control.long_polls import LongPoll, LongPolls
from convoy.control.nodes import NodeRegistry
from convoy.control.protocol import messages as p
from convoy.control.polls import NodePolls
from convoy.control.rendezvous import Rendezvous
from convoy.control.replies import Encoded
from convoy.control.roles.calls import RoleCalls
from convoy.control.shards.master import ShardMaster
from convoy.control.store import Store, read_part, restore
from convoy.control.throttle import EventBudget, budget_for
from convoy.control.token import TOKEN_FILE, new_token, read_token, write_token
from convoy.control.training.calls import TrainCalls
from convoy.errors import ConflictError, StateWriteError
from convoy.sanitize import printable
from convoy.procs import Wakeup

TICK_S = 0.1
ENDED_LOOK_S = 1.0
STATE_RETRY_S = 0.5
"""How often the ticker tries again to write a state that could not be written."""
STATE_WRITE_GIVE_UP_S = 20.0
"""How long the job may go on with its state unwritten (a full disk) before it fails; at most half
the heartbeat timeout, and shorter than an agent waits on the master, so the job fails with this reason."""
UNAUTHORIZED_EVERY_S = 10.0
"""At most one ``unauthorized`` event per client address this often; the rest are counted."""
UNAUTHORIZED_CLIENTS = 1024
HELD_FAILURE_PART = "held_failure"
"""The job's failure held for news of a lost node (``Job.held_failure``), among the saved parts: a master
restarted meanwhile holds it again rather than lose it."""


class JobMaster:
    """The control plane of one job; ``start()`` serves it, ``wait_ended()`` blocks until it ends. Its calls for
    roles and shards are ``role_calls``'s, those of the training manager ``train_calls``'s (the API routes them)."""

    def __init__(self, config: MasterConfig, console: Callable[[str], None] = print, resume: bool = False,
                 token_file: Path | None = None, listener: socket.socket | None = None) -> None:
        """A new job, or with ``resume`` the job in ``config.run_dir`` as its last master left it.

        ``token_file``: use (or create) the token there instead of a new ``run_dir/token``. ``listener``: serve
        on this bound socket (the endpoint its launcher claimed) instead of binding ``config.host:port``.
        """
        now = time.monotonic()
        token_path = token_file or Path(config.run_dir) / TOKEN_FILE
        if resume:
            config, self.job, nodes = restore(config.run_dir, now)
            self.nodes = NodeRegistry(config.heartbeat_timeout_s, {n.node_id: n for n in nodes})
            self.token = read_token(token_path)
        else:
            rdzv_config = config.rendezvous
            rendezvous = Rendezvous(rdzv_config.min_nodes, rdzv_config.max_nodes, rdzv_config.wait_s, now)
            job_id = config.job_id or secrets.token_hex(4)
            self.job = Job(job_id, rendezvous, config.max_restarts, rdzv_config.join_timeout_s)
            self.nodes = NodeRegistry(config.heartbeat_timeout_s)
            self.token = read_token(token_path) if token_file and token_path.exists() else new_token()
        self.job.max_regroups, self.job.regroup_window_s = config.max_regroups, config.regroup_window_s
        self.job.peer_loss_wait_s = config.peer_loss_wait_s
        held = read_part(config.run_dir, HELD_FAILURE_PART) if resume else None
        if held:  # a failure the previous master held for news of a lost node: held again from now
            self.job.held_failure = (p.WorkerExit.model_validate_json(held), now)
        self.config, self.console, self.resumed = config, console, resume
        self._changed = threading.Condition()
        core = MasterCore(self.job, config, self.nodes, self._changed, self._apply)
        self.role_calls = RoleCalls(core, resume)
        self.role_master = self.role_calls.role_master
        """A job of roles: its processes come from the heartbeats' assignments (None: a plain job)."""
        self.job.rendezvous.carry_all = self.role_master is not None
        self.train_calls = TrainCalls(core, self.role_master, resume)
        self.train = self.train_calls.train
        self._stopping = threading.Event()
        self.polls = NodePolls(core, self.role_master, self.train_calls, self._stopping)
        tls = server_tls(config.tls_cert, config.tls_key) if config.tls_cert else None
        self.dashboard = Dashboard([JobEntry(self.job.job_id, Path(config.run_dir), last_seen=self._heard_from)],
                                   self.token, tls is not None)
        # bind first: no state if refused
        self.api = ApiServer(self, config.host, config.port, self.token, tls=tls, pages=self.dashboard,
                             listener=listener, long_polls=LongPolls(self._changed, self.polls.epoch))
        self.dashboard.jobs[self.job.job_id].call = in_process(self.api.routes)
        if not token_path.exists():
            write_token(token_path, self.token)
        self.store = Store(config.run_dir, config.to_json())
        self.role_calls.save_with(self.store)
        self.train_calls.save_with(self.store)
        job = self.job
        self.store.parts[HELD_FAILURE_PART] = lambda: job.held_failure[0].model_dump_json() if job.held_failure else ""
        self._unwritten = threading.local()
        """Per server thread: why the state of the call it is handling could not be written."""
        self._last_write_try = 0.0
        self._refused_since: float | None = None
        """Since when calls are refused (503) for want of a state write: the job is stuck on the disk."""
        self._rejected: dict[str, tuple[float, int]] = {}  # client -> (last recorded, rejected since)
        self._event_budgets: dict[str, EventBudget] = {}  # node id -> its workers' events budget
        self._ended = Wakeup()  # set once the job has ended: wait_ended waits on it in the main thread
        self._ticker = threading.Thread(target=self._tick_loop, name="convoy-ticker", daemon=True)
        self.started_at = time.time()

    @property
    def url(self) -> str:
        host, port = self.api.address
        return f"{host}:{port}"

    @property
    def ended(self) -> bool:
        return self.job.status != RUNNING

    @property
    def shards(self) -> ShardMaster:
        """The datasets' shard queues."""
        return self.role_calls.shards

    def start(self) -> None:
        with self._changed:
            how = f"resumed in round {self.job.round_id}" if self.resumed else "started"
            self._apply([Event("master_started", f"master {how}, listening on {self.url}", console=self.resumed),
                         *self.role_calls.taken_back])
        self.api.start()
        self._ticker.start()
        self.console(f"convoy: dashboard at {self.dashboard.login_link(*self.api.address)} (a one-time login link)")

    def stop(self) -> None:
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()
        self.api.stop()
        self.dashboard.stop()
        with self._changed:
            if self.store.failing_since is not None:
                self._apply([])  # a last try
            if self.store.failing_since is not None:
                self.console(f"convoy: {self.store.pending} events of the job could not be written to "
                             f"{self.store.path} ({self.store.fault})")
        self.store.close()
        self.train_calls.status_store.close()

    def wait_ended(self, timeout: float | None = None) -> bool:
        """Whether the job ended within ``timeout`` seconds (None: no bound), safe where a stop signal raises: it
        waits on ``_ended``, which ``_apply`` sets (the look each second is a bound, not the way it is woken)."""
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        while not self.ended and time.monotonic() < deadline:
            self._ended.wait(min(ENDED_LOOK_S, deadline - time.monotonic()))
        return self.ended

    # --- API calls; each runs on a server thread ---

    def join(self, req: p.JoinRequest) -> p.JoinResponse:
        with self._changed:
            now = time.monotonic()
            busy_window = 2 * self.config.heartbeat_s
            known = self.nodes.nodes.get(req.node_id)
            same_agent = known is not None and known.state == "alive" and bool(req.instance) \
                and known.instance == req.instance
            if self.nodes.register(req.node_id, req.host, req.nproc, now, req.instance, busy_window) is None:
                self._apply([Event("duplicate_node", f"refused a second agent with node id {req.node_id} ({req.host})",
                                   req.node_id)])
                raise ConflictError(f"node id {req.node_id!r} is in use by another running agent; "
                                    "give each agent its own --node-id")
            before = self._decided()
            round_id, events = self.job.join(req.node_id, req.host, req.nproc, req.port, now, req.node_rank,
                                              same_agent)
            if self.role_master is not None:
                self.role_master.sizing.node_memory(req.node_id, req.memory_available_bytes, req.memory_limit_bytes,
                                                    req.cpus)
                memory = min(filter(None, (req.memory_available_bytes, req.memory_limit_bytes)), default=0)
                self.role_master.node_room(req.node_id, memory, req.cpus, req.gpus)
            # a join that decided nothing (no round closed or opened, no order) is made again by a node whose round
            # a restarted master lost; the one that closes a round writes the parts, with every join before it
            self._apply(events, lazy_parts=self._decided() == before)
            refusal = self.job.refusal(req.node_id)
            if refusal is not None:
                self.nodes.mark(req.node_id, "excluded")
                raise ConflictError(refusal)
            return p.JoinResponse(job_id=self.job.job_id, round_id=round_id)

    def _decided(self) -> tuple[int, int, str, int]:
        """What a call may have decided: the round and its membership, the job's status, the role orders queued."""
        news = self.role_master.orders.news if self.role_master is not None else 0
        return self.job.round_id, id(self.job.membership), self.job.status, news

    def wait(self, req: p.WaitRequest) -> p.WaitResponse | Encoded | LongPoll:
        return self.polls.wait(req)

    def heartbeat(self, req: p.HeartbeatRequest) -> p.HeartbeatResponse | LongPoll:
        return self.polls.heartbeat(req)

    def worker_exit(self, report: p.WorkerExit) -> p.Ack:
        with self._changed:
            now = time.monotonic()
            self.nodes.seen(report.node_id, now)
            current = report.round_id == self.job.round_id
            self._apply((self.train_calls.worker_failed(now) if current else []) + self.job.worker_exited(report, now))
            return p.Ack()

    def worker_event(self, report: p.WorkerEvent) -> p.Ack:
        """Record what a worker reported; a node's workers get a budget of records per window."""
        with self._changed:
            now = time.monotonic()
            self.nodes.seen(report.node_id, now)
            dropped = budget_for(self._event_budgets, report.node_id, now).admit(now)
            if dropped is None:
                return p.Ack()
            if report.round_id != self.job.round_id or self.job.membership is None:
                self._apply([Event("stale_report", f"ignored a {report.kind} event from round {report.round_id}",
                                   report.node_id, report.round_id)])
                return p.Ack()
            more = f" ({dropped} more from node {report.node_id} not recorded)" if dropped else ""
            self._apply([Event(report.kind, f"rank {report.rank}: {printable(report.message)}{more}", report.node_id,
                               report.round_id, console=True)])
            return p.Ack()

    def node_done(self, req: p.NodeDone) -> p.Ack:
        with self._changed:
            self._apply(self.job.node_done(req.node_id, req.round_id))
            return p.Ack()

    def leave(self, req: p.LeaveRequest) -> p.Ack:
        with self._changed:
            self.nodes.mark(req.node_id, "left")
            lost = self.role_master.node_lost(req.node_id) if self.role_master else []
            self._apply(lost + self.job.node_lost(req.node_id, f"left ({printable(req.reason) or 'agent exited'})",
                                                  time.monotonic()))
            return p.Ack()

    def wait_acknowledged(self, timeout: float) -> None:
        """After the end: wait (bounded) until every live agent has been told the outcome."""
        def everyone_told() -> bool:
            alive = {n.node_id for n in self.nodes.nodes.values() if n.state == "alive"}
            return alive <= self.polls.acknowledged

        with self._changed:
            self._changed.wait_for(everyone_told, timeout)

    def abort(self, reason: str) -> None:
        with self._changed:
            self._apply(self.job.abort(reason))

    def api_fault(self, path: str, exc: BaseException) -> None:
        with self._changed:
            self._apply([Event("api_error", f"{path} failed: {type(exc).__name__}: {exc}"[:2000])])

    def unauthorized(self, client: str, path: str) -> None:
        """Record a request without the token; a flood from one client becomes one event per interval."""
        now = time.monotonic()
        with self._changed:
            last, since = self._rejected.get(client, (-UNAUTHORIZED_EVERY_S, 0))
            if now - last < UNAUTHORIZED_EVERY_S:
                self._rejected[client] = (last, since + 1)
                return
            if len(self._rejected) >= UNAUTHORIZED_CLIENTS:  # bounded: forget clients not heard from lately
                self._rejected = {c: v for c, v in self._rejected.items() if now - v[0] < UNAUTHORIZED_EVERY_S}
            self._rejected[client] = (now, 0)
            more = f" ({since} more from it since the last record)" if since else ""
            self._apply([Event("unauthorized", f"rejected {path} from {client}: missing or wrong token{more}")])

    def _heard_from(self) -> dict[str, float]:
        """Each node's last heartbeat, wall clock (the dashboard's nodes page)."""
        with self._changed:
            to_wall = time.time() - time.monotonic()
            return {node.node_id: node.last_seen + to_wall for node in self.nodes.nodes.values()}

    def status(self) -> dict[str, Any]:
        with self._changed:
            membership = self.job.membership
            return {"job_id": self.job.job_id, "status": self.job.status, "round_id": self.job.round_id,
                    "restart_count": self.job.restart_count, "outcome": self.job.outcome,
                    "round": self.polls.round_info(membership).model_dump() if membership else None}

    # --- internals ---

    def take_unwritten(self) -> str | None:
        """Why the state of this thread's last call could not be written (None if it was); resets it."""
        reason, self._unwritten.reason = getattr(self._unwritten, "reason", None), None
        return reason

    def state_fault(self) -> str | None:
        """Why the job's state cannot be written now, or None when it is up to date on disk."""
        with self._changed:
            return self.store.fault if self.store.failing_since is not None else None

    def refused_for_disk(self) -> None:
        """A call was answered 503 because its state is not on disk: from now on the job waits on the disk."""
        with self._changed:
            if self._refused_since is None and self.store.failing_since is not None:
                self._refused_since = time.monotonic()

    def _apply(self, events: list[Event], lazy_parts: bool = False, rows_only: bool = False) -> None:
        """Record, print, and wake waiters; caller holds ``self._changed``. ``lazy_parts``, ``rows_only``: see
        ``Store.save``.

        A write that fails (a full disk) changes nothing in memory: the events are kept and
        written by a later save, the console still gets them, and waiters are still woken.
        """
        was_failing = self.store.failing_since is not None
        now, ranks = time.monotonic(), self.job.membership
        rows, every = self.nodes.to_write(ranks, now)
        try:
            note = self.store.save(self.job, events, self.url, rows, lazy_parts, rows_only)
            self.nodes.written(ranks, every, now)
        except StateWriteError as exc:
            if not was_failing:  # one line when the writes start failing, one when they work again
                self.console(f"convoy: {exc}; the job goes on in memory and the write is retried")
            self._unwritten.reason = str(exc)
        else:
            if note is not None:
                self._refused_since = None
                self.console(f"convoy: {note}")
        for event in events:
            if event.console:
                self.console(f"convoy: {printable(event.message, keep_lines=True)}")
        self.polls.applied()
        self._changed.notify_all()
        if self.ended:
            self._ended.set()

    def _state_write_give_up(self, now: float) -> list[Event]:
        """Fail the job once agents have waited on an unwritten state too long (a job that only trains goes on)."""
        since = self._refused_since
        limit = min(STATE_WRITE_GIVE_UP_S, self.config.heartbeat_timeout_s / 2)
        if since is None or now - since < limit:
            return []
        return self.job.abort(f"the job's state cannot be written to {self.store.path} for {limit:.0f} s "
                              f"({self.store.fault}); free space in the run dir, then run the job again")

    def _tick_loop(self) -> None:
        while not self._stopping.wait(TICK_S):
            with self._changed:
                if self.ended:
                    self.role_calls.pool_tick()  # withdraws the job's claim from the pool, once
                    continue
                now = time.monotonic()
                events = self.job.tick(now)
                for node_id in self.nodes.expired(now):
                    events += self.role_master.node_lost(node_id) if self.role_master else []
                    events += self.job.node_lost(node_id, f"sent no heartbeat for {self.nodes.timeout_s:.0f} s", now)
                events += self.role_master.advance(now) if self.role_master else []
                self.polls.tick(now)
                events += self.role_calls.pool_tick()
                events += self.train_calls.advance(now)
                events += self._state_write_give_up(now)
                retry = self.store.failing_since is not None and now - self._last_write_try >= STATE_RETRY_S
                stale = self.nodes.rows_stale(now) and self.store.failing_since is None  # their last-seen times
                owed = self.store.parts_owed and self.store.parts_due()  # parts a burst of changes left for later
                if events or retry or stale or owed:
                    self._last_write_try = now
                    self._apply(events, rows_only=not (events or retry or owed))
