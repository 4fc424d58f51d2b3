"""Worker processes of one node: a fork server (or warm standbys), log pumps, start, poll, and stop.

A node's workers are forked from one fork server (``forkserver.py``) that imported the preload list once: a
round's workers, and every restart's, start in milliseconds, and nproc workers cost one import of torch rather
than nproc at once (on 2 cores, two concurrent imports take each about twice as long). Where the server cannot
be used (``--no-python``: a worker becomes another executable; an empty ``--preload``; a server that cannot
start or dies before it has preloaded), each worker is a standby of its own: a process that imports the preload
list ahead of its round, then waits for its rank. A server that dies later, or stops answering (and is killed
for it), gives way to a fresh one; the workers that died with it carry its fault (``ForkedProcess.fault``)."""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from convoy import log
from convoy.agent.env import spawn_env, worker_env
from convoy.agent.forked import KILL_WAIT_S, ForkedProcess, ForkServer, wait_bounded
from convoy.agent.log_pump import Failures, LogPump
from convoy.agent.reap import NodeCgroup
from convoy.agent.round_store import STORE_BIND, hosted_by_rank0
from convoy.config import WorkerConfig
from convoy.errors import WorkerStartError
from convoy.procs import die_with_parent

if TYPE_CHECKING:
    from convoy.control.protocol.messages import MemberInfo, RoundInfo

REFILL_DELAY_S = 5.0
FORK_READY_S = 120.0
"""How long a round's start waits for the fork server to finish preloading."""


@dataclass
class Worker:
    proc: subprocess.Popen[bytes] | ForkedProcess
    pump: LogPump
    ready_fd: int
    """Read end of a pipe the standby writes to once its preloading is done (-1: forked, preloaded already)."""
    local_rank: int = -1
    rank: int = -1
    _ready: bool = False

    def preloaded(self) -> bool:
        """True once the standby has imported its preload modules (or has died)."""
        if not self._ready and select.select([self.ready_fd], [], [], 0)[0]:
            self._ready = True
            os.close(self.ready_fd)
        return self._ready

    def release(self) -> None:
        if not self._ready:
            self._ready = True
            os.close(self.ready_fd)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        """Signal the worker's process group (a forked worker not yet in a session of its own: the worker)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        except PermissionError:
            pass


class WorkerGroup:
    """The local workers of one node, forked from the node's fork server (else ``nproc`` warm standbys kept
    ready for the next round)."""

    def __init__(self, config: WorkerConfig, run_dir: Path, console: BinaryIO | None = None,
                 host: str | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self._env = spawn_env(config.nproc_per_node, host=host)
        self._console = console or sys.stdout.buffer
        self._console_lock = threading.Lock()
        self._standbys: list[Worker] = []
        self._forks: ForkServer | None = None
        self._forking = bool(config.preload) and not config.no_python
        """Whether the workers are forked from a fork server (False for good once one fails)."""
        self.workers: list[Worker] = []
        self._started_at = 0.0
        self.lease_file = ""
        """The node's round lease (``CONVOY_LEASE`` for the workers), once the agent has made it."""
        self.agent_env: dict[str, str] = {}
        """How the workers reach the agent's local API (``CONVOY_AGENT_URL``, ``CONVOY_AGENT_TOKEN``)."""
        self.cgroup: NodeCgroup | None = None
        """Where this node's workers and all they start are kept, where a cgroup hierarchy is writable."""
        self.events: queue.SimpleQueue[tuple[int, str, str]] = queue.SimpleQueue()
        """Events the workers recorded, ``(rank, kind, message)``, for the agent to send on."""
        self.failures = Failures()
        """The first failure of the running round (the workers failing after it get a line each)."""
        self.node_id = ""
        """The node's id (``name_node``)."""

    def name_node(self, node_id: str) -> None:
        """The node's id, for the lines that name it and its fork server."""
        self.node_id = node_id
        if self._forks is not None:
            self._forks.node_id = node_id

    def adopt(self, forks: ForkServer) -> None:
        """Fork the workers from ``forks``, which the launcher started before this agent; closed at once where the
        workers are not forked (``--no-python``, an empty ``--preload``)."""
        if self._forking and self._forks is None:
            self._forks = forks
            forks.node_id = self.node_id
        else:
            forks.close()

    def fill_standbys(self) -> None:
        """Start the fork server, or standbys until there is one per local worker (call from the main thread)."""
        if self._forking and self._forks is None:
            try:
                self._forks = ForkServer.start(self.config.preload, self._env)
            except OSError as exc:
                self._stop_forking(f"cannot start the fork server ({exc})")
            else:
                self._forks.node_id = self.node_id
                if self.cgroup is not None:
                    self.cgroup.add(self._forks.pid)  # what it forks is born in the node's cgroup
        if self._forking:
            return
        while len(self._standbys) < self.config.nproc_per_node:
            try:
                self._standbys.append(self._spawn())
            except OSError as exc:
                raise WorkerStartError(f"cannot start a worker process ({sys.executable}): {exc}") from exc

    def wait_preloaded(self, timeout: float) -> bool:
        """Start the fork server or standbys if needed and wait (bounded) until they have imported their preload
        list."""
        self.fill_standbys()
        for _ in range(2):  # a server that dies once ready gives way to a fresh one, once per call
            self.keep_fork_server()
            if self._forks is None:
                break
            if self._forks.wait_ready(timeout):
                return True
            if self._forks.alive:
                return False
            if not self._forks.preloaded:  # a fresh one would fare no better
                self._stop_forking(f"{self._forks.check()} before it had preloaded")
                self.fill_standbys()
        deadline = time.monotonic() + timeout
        while not all(standby.preloaded() for standby in self._standbys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def refill_when_idle(self, now: bool = False) -> None:
        """Warm the next round's standbys once this round's workers are done importing and have run
        ``REFILL_DELAY_S``, so the imports do not compete with the workers' start and first steps; ``now``: a
        restart of the training config is coming, and the next round needs them sooner."""
        settled = now or time.monotonic() - self._started_at >= REFILL_DELAY_S
        if settled and len(self._standbys) < self.config.nproc_per_node and all(w.preloaded() for w in self.workers):
            self.fill_standbys()

    def _spawn(self) -> Worker:
        ready_read, ready_write = os.pipe()
        preload = "" if self.config.no_python else ",".join(self.config.preload)  # an exec would drop what it loaded
        command = [sys.executable, "-m", "convoy.agent.standby", preload, str(ready_write)]
        try:
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self._env,
                start_new_session=True, pass_fds=(ready_write,), preexec_fn=lambda: die_with_parent(signal.SIGKILL),
            )
        except BaseException:
            os.close(ready_read)
            raise
        finally:
            os.close(ready_write)
        if self.cgroup is not None:
            self.cgroup.add(proc.pid)
        assert proc.stdout is not None
        pump = LogPump(proc.stdout, self._console, self._console_lock, self.events,  # type: ignore[arg-type]
                       self.failures)
        pump.start()
        return Worker(proc, pump, ready_read)

    def keep_fork_server(self) -> None:
        """A fork server that died once it had preloaded, or stopped answering (and was killed for it), gives way
        to a fresh one, with one line saying so (the workers that died with it report its fault)."""
        if self._forks is None or not self._forks.preloaded:
            return
        fault = self._forks.check()
        if fault:
            log.warning(f"convoy agent {self.node_id}: {fault}; a fresh one takes its place")
            old, self._forks = self._forks, None
            old.close()
            self.fill_standbys()

    def _stop_forking(self, why: str) -> None:
        """Start each worker as a standby of its own from now on (the fork server, if any, ends with its
        processes)."""
        log.warning(f"convoy agent: {why}; each worker starts as a process of its own")
        self._forking = False
        if self._forks is not None:
            self._forks.close()
            self._forks = None

    def use_cgroup(self, cgroup: NodeCgroup) -> None:
        """Keep every worker, the fork server and the standbys already started included, in ``cgroup`` from now
        on."""
        self.cgroup = cgroup
        for pid in [*([self._forks.pid] if self._forks is not None else []),
                    *(worker.proc.pid for worker in [*self._standbys, *self.workers])]:
            cgroup.add(pid)

    @property
    def uses_round_store(self) -> bool:
        """Whether rank 0's process serves the round's store before its script runs (``round_store.py``)."""
        return hosted_by_rank0(self.config.no_python, self.config.preload)

    def start(self, round_info: RoundInfo, member: MemberInfo, master_url: str,
              store: socket.socket | None = None) -> None:
        """Fork this round's workers (else hand each standby its rank, then warm new standbys for the next one);
        WorkerStartError where no worker process can be started. ``store``: where this node runs rank 0 and
        ``uses_round_store``, the listening socket the node offered as MASTER_PORT; rank 0 serves the round's
        store on it (a standby binds the port itself, once it is closed). Closed here in every case."""
        try:
            self._start(round_info, member, master_url, store)
        finally:
            if store is not None:
                store.close()

    def _start(self, round_info: RoundInfo, member: MemberInfo, master_url: str, store: socket.socket | None) -> None:
        self.fill_standbys()
        self._started_at = time.monotonic()
        self.failures.reset()
        self.workers = []
        logs = Path(self.config.log_dir) if self.config.log_dir else self.run_dir / "logs"
        log_dir = logs / f"round{round_info.round_id}"
        envs = []
        for local_rank in range(member.nproc):
            log_file = log_dir / f"rank{member.rank_offset + local_rank}.log"
            env = worker_env(round_info, member, local_rank, str(self.run_dir), master_url, str(log_file),
                             self.config.role_name, round_store=self.uses_round_store)
            if self.lease_file:
                env["CONVOY_LEASE"] = self.lease_file
            envs.append({**env, **self.agent_env})
        serves = member.rank_offset == 0 and self.uses_round_store  # this node's local rank 0 is rank 0
        if serves and store is None:
            envs[0][STORE_BIND] = "1"  # no socket to hand over: rank 0 binds the port itself
        if self._forks is not None:
            self.workers = self._fork_round(envs, store if serves else None)
        if not self.workers:
            if store is not None:
                store.close()  # the standby of rank 0 binds the port itself
            if serves:
                envs[0][STORE_BIND] = "1"
            self.workers, self._standbys = self._standbys[: member.nproc], self._standbys[member.nproc :]
        for local_rank, (worker, env) in enumerate(zip(self.workers, envs)):
            worker.local_rank, worker.rank = local_rank, member.rank_offset + local_rank
            worker.pump.assign(worker.rank, Path(env["CONVOY_LOG_FILE"]), show=self.config.shows_console(local_rank))
            if isinstance(worker.proc, ForkedProcess):
                continue
            order = {"env": env, "argv": self._argv(), "entrypoint": self.config.entrypoint,
                     "module": self.config.module, "no_python": self.config.no_python}
            try:
                assert worker.proc.stdin is not None
                worker.proc.stdin.write(json.dumps(order).encode() + b"\n")
                worker.proc.stdin.close()
            except BrokenPipeError:
                pass  # the standby died before its order arrived; poll() reports its exit

    def _fork_round(self, envs: list[dict[str, str]], store: socket.socket | None) -> list[Worker]:
        """The round's workers from the fork server; where it died or did not answer, once more from a fresh one;
        none (and standbys from now on) where that fails too."""
        try:
            return self._fork(envs, store)
        except WorkerStartError as exc:
            failure = exc
        self.keep_fork_server()
        if self._forks is not None and self._forks.alive:
            try:
                return self._fork(envs, store)
            except WorkerStartError as exc:
                failure = exc
        self._stop_forking(str(failure))
        self.fill_standbys()
        return []

    def _fork(self, envs: list[dict[str, str]], store: socket.socket | None) -> list[Worker]:
        """One process per environment from the fork server (each already holds the preloaded modules; the
        first serves the round's store on ``store``, if given); where one cannot be forked, those forked before it
        are killed and WorkerStartError raised."""
        assert self._forks is not None
        cgroups = [str(self.cgroup.path)] if self.cgroup is not None else []
        forked: list[Worker] = []
        try:
            for env in envs:
                proc = self._forks.spawn({**self._env, **env}, self._argv(), self.config.entrypoint,
                                         self.config.module, cgroups, FORK_READY_S, own_pages=False,
                                         store=store if not forked else None)
                pump = LogPump(proc.stdout, self._console, self._console_lock, self.events, self.failures)
                pump.start()
                forked.append(Worker(proc, pump, -1, _ready=True))
        except WorkerStartError:
            for worker in forked:
                worker.signal(signal.SIGKILL)
                wait_bounded(worker.proc, KILL_WAIT_S)
                worker.pump.join(timeout=2.0)
            raise
        return forked

    def _argv(self) -> list[str]:
        first = self.config.entrypoint if not self.config.module or self.config.no_python else \
            f"-m {self.config.entrypoint}"
        return [first, *self.config.args]

    def poll(self) -> tuple[list[Worker], list[Worker]]:
        """Return (finished with 0, failed) among this round's workers (and keep the fork server working)."""
        self.keep_fork_server()
        done = [w for w in self.workers if w.returncode == 0]
        failed = [w for w in self.workers if w.returncode not in (None, 0)]
        return done, failed

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM this round's workers (each its own process group), SIGKILL after the grace period."""
        grace = self.config.stop_grace_s if grace_s is None else grace_s
        alive = [w for w in self.workers if w.returncode is None]
        for worker in alive:
            worker.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            time.sleep(0.01)
            alive = [w for w in alive if w.returncode is None]
        for worker in self.workers:
            worker.signal(signal.SIGKILL)  # also reaches children a finished worker left behind
            if wait_bounded(worker.proc, KILL_WAIT_S) is None:
                log.warning(f"convoy agent {self.node_id}: rank {worker.rank} (pid {worker.proc.pid}) did not end "
                            f"within {KILL_WAIT_S:.0f} s of SIGKILL; the node's reap ends it")
            worker.pump.join(timeout=2.0)
            worker.release()
        self.workers = []

    def close(self) -> None:
        """Stop everything this group started, standbys included."""
        self.stop()
        for standby in self._standbys:
            standby.signal(signal.SIGKILL)
            wait_bounded(standby.proc, KILL_WAIT_S)
            standby.release()
        self._standbys = []
        if self._forks is not None:
            self._forks.close()
            self._forks = None
