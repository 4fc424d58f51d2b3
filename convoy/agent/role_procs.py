"""The role processes of one node: started from the master's assignments, watched, stopped on its word.

Each is forked from the node's fork server (``forkserver.py``: ``import torch`` paid once per node, not per
process), or, without one, runs ``python SCRIPT`` (or ``-m MODULE``) itself; either way in its own session, set
to die with the agent, in its cgroups from the start, with the job's CONVOY_* variables, its role (``role_env``)
and the port it serves on (CONVOY_ROLE_PORT), and the threads of its role's ``cpus`` (OMP_NUM_THREADS; 1 where the
role declares none and the job's environment sets none, as torchrun gives each of several workers a node: the
processes of a node share its cores). Its output goes through a LogPump to
``RUN_DIR/logs/roles/<role><rank>.log`` and, prefixed ``[<role><rank>]``, to the console.

Every exit is reported once, with its incarnation, however it came: on its own, stopped on the master's word,
stopped by the agent to make room for a newer incarnation of its rank, ended at the job's end, or killed with a
fork server that died or stopped answering (then with the server's fault as ``infrastructure``; a fresh server
takes its place). Every wait on a process is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

from convoy import log
from convoy.agent.cpu_limits import AFFINITY, CpuLimit, CpuLimiter
from convoy.agent.env import STEADY_MALLOC, role_spawn_env
from convoy.agent.forked import KILL_WAIT_S, ForkedProcess, ForkServer, fault_of, wait_bounded
from convoy.agent.gpus import node_gpus, visible_devices
from convoy.agent.log_pump import LogPump
from convoy.agent.memory_limits import CgroupMemoryLimit, MemoryLimit
from convoy.agent.reap import NodeCgroup
from convoy.agent.role_memory import RoleMemory
from convoy.config import WorkerConfig
from convoy.control.protocol import messages as p
from convoy.errors import ConfigError, WorkerStartError
from convoy.ports import can_listen, unclaimed_port
from convoy.procs import die_with_parent, signal_name
from convoy.worker.lease import LEASE_ENV
from convoy.worker.role_env import (ADDRESSES_FILE_ENV, INCARNATION_ENV, PREEMPT_FILE_ENV, addresses_file,
                                    group_env, preempt_file, role_env, service_env)

ROLE_PORT_ENV = "CONVOY_ROLE_PORT"
Key = tuple[str, int, int]
FORK_READY_S = 120.0
"""How long the first process waits for the fork server to finish preloading before it starts on its own."""


@dataclass
class RoleProcess:
    assignment: p.RoleAssignment
    proc: subprocess.Popen[bytes] | ForkedProcess
    pump: LogPump
    address: str
    kill_at: float | None = None
    """When a process told to stop gets SIGKILL (None: not told to stop)."""
    term_at: float | None = None
    """When a preempted process, told at once, gets SIGTERM (None: not preempted, or sent already)."""
    cpu: CpuLimit | None = None
    """The kernel's hold on its role's ``cpus`` (None: the role declares none)."""
    slot: int = 0
    """Its LOCAL_RANK: the lowest not taken by the node's other role processes when it started."""

    @property
    def key(self) -> Key:
        return (self.assignment.role, self.assignment.rank, self.assignment.incarnation)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class JobContext:
    """What every role process of this node is told about the job."""

    job_id: str
    node_id: str
    host: str
    run_dir: Path
    master_url: str
    agent_env: dict[str, str] = field(default_factory=dict)
    """How the processes reach the agent's local API (``CONVOY_AGENT_URL``, ``CONVOY_AGENT_TOKEN``)."""
    job_token: str = ""
    """The job's token: never given to a process; the role services' key is derived from it (``service_env``)."""
    tls: bool = False
    """The job runs with TLS (the agent reaches the master through ``--tls-ca``): so do its role services."""
    lease_file: str = ""
    """The node's lease (``CONVOY_LEASE``): a process whose lease expired (its agent silent a whole heartbeat
    timeout) stops itself (``lease_watch.py``); empty: none."""


class RoleProcesses:
    """Starts, polls and stops this node's role processes; ``start`` ignores an incarnation it has started."""

    def __init__(self, workers: WorkerConfig, context: JobContext, cgroup: NodeCgroup | None = None,
                 console: BinaryIO | None = None, memory: RoleMemory | None = None,
                 forks: ForkServer | None = None, fresh_forks: Callable[[], ForkServer | None] | None = None) -> None:
        self.workers, self.context, self.cgroup, self.memory = workers, context, cgroup, memory
        self.forks = forks
        """Where the processes are forked from (None: each starts as ``python SCRIPT``)."""
        self.fresh_forks = fresh_forks
        """Starts a fresh fork server in place of one that failed (None, or returning None: none can start)."""
        self.running: dict[Key, RoleProcess] = {}
        self.seen: set[Key] = set()
        self._ended: list[tuple[RoleProcess, p.RoleReport]] = []
        """Processes ended outside ``poll`` (stopped to make room), their reports not yet handed out."""
        self._console = console or sys.stdout.buffer
        self._console_lock = threading.Lock()
        self._env = role_spawn_env(context.host)
        self.cpus = CpuLimiter()
        self.gpus = node_gpus()
        """The node's devices as CUDA names them: an assignment's ``gpus`` index into this list."""

    def start(self, assignment: p.RoleAssignment) -> RoleProcess | None:
        """Start the process, or None when this incarnation was started already. An older incarnation of the
        same rank still running is stopped first (it may hold the port); ``carry_out`` and ``poll`` report its
        exit."""
        key = (assignment.role, assignment.rank, assignment.incarnation)
        if key in self.seen:
            return None
        self.seen.add(key)
        for older in [proc for proc in self.running.values() if proc.key[:2] == key[:2]]:
            self._stop_now([older])
        port = assignment.port if assignment.port and can_listen(assignment.port) \
            else unclaimed_port(self.context.host)  # a rank's old port taken: a new one, which the master publishes
        name = f"{assignment.role}{assignment.rank}"
        log_path = self.context.run_dir / "logs" / "roles" / f"{name}.log"
        slot = min(set(range(len(self.running) + 1)) - {other.slot for other in self.running.values()})
        limit = self.memory.limit_for(assignment) if self.memory is not None else None
        steady = STEADY_MALLOC if limit is not None or assignment.measure else {}
        env = {**steady, **self._env, **self._job_env(assignment, port, log_path), **self._devices(assignment, slot)}
        if assignment.threads or "OMP_NUM_THREADS" not in env:  # several processes share a node's cores
            env["OMP_NUM_THREADS"] = str(assignment.threads or 1)
        cpu = self._cpu_limit(name, assignment, limit)
        try:
            proc = self._spawn(name, assignment, env, limit, cpu)
        except BaseException:
            if limit is not None:
                limit.close()
            if cpu is not None:
                self.cpus.release(cpu)
            raise
        if cpu is not None:
            cpu.apply(proc.pid)  # a forked process joined its cgroup before it ran anything; pinned, or moved here
        if limit is not None:
            limit.add(proc.pid)  # a forked process is in its cgroup already; the watchdog learns of it here
        if self.memory is not None:
            self.memory.started(assignment, proc.pid, limit)
        assert proc.stdout is not None
        sink = self.memory.sink(key) if self.memory is not None else None
        pump = LogPump(proc.stdout, self._console, self._console_lock, sink)  # type: ignore[arg-type]
        pump.assign(assignment.rank, log_path, label=name)
        pump.start()
        process = RoleProcess(assignment, proc, pump, f"{self.context.host}:{port}", cpu=cpu, slot=slot)
        self.running[key] = process
        return process

    def _cpu_limit(self, name: str, assignment: p.RoleAssignment, memory: MemoryLimit | None) -> CpuLimit | None:
        """The kernel's hold on the role's ``cpus``: in the process's v2 memory cgroup where it has one (a v2
        process is in one cgroup only), else a cgroup of its own, else pinned CPUs."""
        if not assignment.cpus:
            return None
        shared = memory.path if isinstance(memory, CgroupMemoryLimit) else None
        v2 = isinstance(memory, CgroupMemoryLimit) and memory.v2
        cpu = self.cpus.limit(name, assignment.cpus, shared if v2 else None, v2)
        if cpu.mechanism == AFFINITY and len(self.cpus.refusals) and not self.cpus.warned:
            self.cpus.warned = True
            log.warning(f"convoy agent {self.context.node_id}: no writable cpu cgroup ({'; '.join(self.cpus.refusals)})"
                        "; a role's cpus pin its processes to that many CPUs instead")
        return cpu

    def _devices(self, assignment: p.RoleAssignment, slot: int) -> dict[str, str]:
        """LOCAL_RANK (the process's slot on the node) and, where the job hands out GPUs, the devices it was
        handed as CUDA_VISIBLE_DEVICES (it sees them as cuda:0, ...; none for a role that takes none). A job whose
        roles declare no GPUs leaves each process the node's devices, as before."""
        env = {"LOCAL_RANK": str(slot)}
        if assignment.gpus_managed:
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(self.gpus, assignment.gpus)
        return env

    def _spawn(self, name: str, assignment: p.RoleAssignment, env: dict[str, str], limit: MemoryLimit | None,
               cpu: CpuLimit | None = None) -> subprocess.Popen[bytes] | ForkedProcess:
        """Fork the process from the fork server, which joins it to its cgroups (the node's, its limits')
        before it runs anything; a process of its own where there is no server or it fails."""
        entry, module, args = self._entry(assignment)
        cgroups = [str(self.cgroup.path)] if self.cgroup is not None else []
        if isinstance(limit, CgroupMemoryLimit):
            cgroups.append(str(limit.path))
        if cpu is not None and cpu.cgroup is not None and cpu.own_cgroup:
            cgroups.append(str(cpu.cgroup))
        for _ in range(2):  # a server that died or did not answer gives way to a fresh one, which gets a try
            server = self.forks
            if server is None:
                break
            try:
                return server.spawn(env, [entry, *args], entry, module, cgroups, FORK_READY_S,
                                    own_pages=limit is not None or assignment.measure)
            except WorkerStartError as exc:
                failure = exc
            if self.keep_fork_server() and self.forks is server:  # it works, yet could not fork this one
                log.warning(f"convoy agent {self.context.node_id}: {failure}; {name} and the role processes after it "
                            "start as processes of their own")
                self.forks = None
        try:
            proc = subprocess.Popen(  # the script as python runs it, beside its lease's watcher
                [sys.executable, "-m", "convoy.agent.watched", *(["-m", entry] if module else [entry]), *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGKILL),
            )
        except OSError as exc:
            raise WorkerStartError(f"cannot start {name} ({sys.executable}): {exc}") from exc
        if self.cgroup is not None:
            self.cgroup.add(proc.pid)
        return proc

    def carry_out(self, assignments: list[p.RoleAssignment], stops: list[p.RoleStop]) -> list[p.RoleReport]:
        """Stops first (a rank's old process may hold the port its new one gets), then starts; the reports for
        the master (the exit of an older incarnation stopped to make room before its successor's start)."""
        for stop in stops:
            self.stop(stop)
        reports = []
        for assignment in assignments:
            report = p.RoleReport(node_id=self.context.node_id, role=assignment.role, rank=assignment.rank,
                                  incarnation=assignment.incarnation, state="started")
            try:
                process = self.start(assignment)
            except (WorkerStartError, ConfigError, OSError) as exc:
                log.warning(f"convoy agent {self.context.node_id}: {exc}")
                report.state, report.start_failed, report.log_tail = "exited", True, [str(exc)]
                process = None
            reports += [ended for _, ended in self._take_ended()]  # an older incarnation stopped to make room
            if report.state == "started":
                if process is None:
                    # a repeat of the assignment (redelivered, or from a restarted master that missed the
                    # report): say again that it runs; one that exited since is reported by poll
                    process = self.running.get((assignment.role, assignment.rank, assignment.incarnation))
                    if process is None:
                        continue
                report.address, report.pid = process.address, process.proc.pid
                report.cpu_limit = process.cpu.describe() if process.cpu is not None else ""
            reports.append(report)
        return reports

    def stop(self, stop: p.RoleStop) -> None:
        """SIGTERM now; ``poll`` sends SIGKILL once the stop grace has passed. A preempted process (``notice_s``) is
        told at once (its notice file) and gets SIGTERM only after ``notice_s``."""
        key = (stop.role, stop.rank, stop.incarnation)
        process = self.running.get(key)
        if process is None or process.kill_at is not None:
            return
        now = time.monotonic()
        if stop.notice_s > 0:
            notice = preempt_file(self.context.run_dir, *key)
            notice.parent.mkdir(parents=True, exist_ok=True)
            notice.write_text(stop.reason + "\n")
            process.term_at = now + stop.notice_s
        else:
            process.signal(signal.SIGTERM)
        process.kill_at = now + stop.notice_s + self.workers.stop_grace_s

    def poll(self) -> list[tuple[RoleProcess, p.RoleReport]]:
        """The processes that exited since the last call, each with its report for the master (a fork server that
        failed is replaced first: the processes that died with it are among them)."""
        self.keep_fork_server()
        exited = self._take_ended()
        now = time.monotonic()
        for key, process in list(self.running.items()):
            code = process.proc.poll()
            if code is None:
                if process.term_at is not None and now >= process.term_at:
                    process.term_at = None
                    process.signal(signal.SIGTERM)  # preempted, and the grace to finish its unit is over
                if process.kill_at is not None and now >= process.kill_at:
                    process.signal(signal.SIGKILL)
                continue
            process.signal(signal.SIGKILL)  # what it left running in its group
            process.pump.join(timeout=2.0)  # its group is gone, so the pipe closes: its last lines reach the tail
            del self.running[key]
            self._release(process)
            preempt_file(self.context.run_dir, *key).unlink(missing_ok=True)
            exited.append((process, self._exit_report(process, code)))
        return exited

    def exit_report(self, process: RoleProcess, code: int) -> p.RoleReport:
        role, rank, incarnation = process.key
        return p.RoleReport(node_id=self.context.node_id, role=role, rank=rank, incarnation=incarnation,
                            state="exited", exitcode=code if code >= 0 else None, signal=signal_name(code),
                            log_path=process.pump.log_path, log_tail=list(process.pump.tail),
                            infrastructure=fault_of(process.proc))

    def stop_all(self) -> list[p.RoleReport]:
        """The end of the job on this node: SIGTERM every process, SIGKILL what is left after the grace; the
        exit reports not yet handed out (these, and any ended since the last ``poll``)."""
        self._stop_now(list(self.running.values()))
        self.running.clear()
        reports = [report for _, report in self._take_ended()]
        if self.memory is not None:
            self.memory.close()
        return reports

    def keep_fork_server(self) -> bool:
        """Whether the processes are forked from a working server: one that died, or stopped answering (and was
        killed for it), gives way to a fresh one, with one line saying so (the processes that died with it are
        reported with its fault)."""
        if self.forks is None:
            return False
        fault = self.forks.check()
        if not fault:
            return True
        fresh = self.fresh_forks() if self.fresh_forks is not None else None
        what = "a fresh one takes its place" if fresh is not None else "role processes start as processes of their own"
        log.warning(f"convoy agent {self.context.node_id}: {fault}; {what}")
        self.forks.close()
        self.forks = fresh
        return fresh is not None

    def _stop_now(self, processes: list[RoleProcess]) -> None:
        """SIGTERM, SIGKILL after the grace, each wait bounded; their exits are kept for the next report."""
        for process in processes:
            process.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.workers.stop_grace_s
        while time.monotonic() < deadline and any(process.proc.poll() is None for process in processes):
            time.sleep(0.01)
        for process in processes:
            process.signal(signal.SIGKILL)
            code = wait_bounded(process.proc, KILL_WAIT_S)
            if code is None:
                log.warning(f"convoy agent {self.context.node_id}: {process.assignment.role} {process.assignment.rank} "
                            f"(pid {process.proc.pid}) did not end within {KILL_WAIT_S:.0f} s of SIGKILL; reported "
                            "killed, the node's reap ends it")
            process.pump.join(timeout=2.0)
            self.running.pop(process.key, None)
            self._release(process)
            self._ended.append((process, self._exit_report(process, -signal.SIGKILL if code is None else code)))

    def _exit_report(self, process: RoleProcess, code: int) -> p.RoleReport:
        report = self.exit_report(process, code)
        return self.memory.exited(process.key, report) if self.memory is not None else report

    def _release(self, process: RoleProcess) -> None:
        if process.cpu is not None:
            self.cpus.release(process.cpu)

    def _take_ended(self) -> list[tuple[RoleProcess, p.RoleReport]]:
        ended, self._ended = self._ended, []
        return ended

    def _entry(self, assignment: p.RoleAssignment) -> tuple[str, bool, list[str]]:
        """(script or module, whether a module, arguments) of the assignment's process."""
        if assignment.entrypoint:
            return assignment.entrypoint, assignment.module, list(assignment.args)
        return self.workers.entrypoint, self.workers.module, [*self.workers.args, *assignment.args]  # the job's

    def _job_env(self, assignment: p.RoleAssignment, port: int, log_path: Path) -> dict[str, str]:
        context = self.context
        return {
            **role_env(assignment.role, assignment.rank, assignment.world_size, assignment.addresses),
            ROLE_PORT_ENV: str(port),
            INCARNATION_ENV: str(assignment.incarnation),
            "CONVOY_ROLE_RESTORE": "1" if assignment.restore else "0",
            "CONVOY_JOB_ID": context.job_id,
            "CONVOY_NODE_ID": context.node_id,
            "CONVOY_RUN_DIR": str(context.run_dir),
            "CONVOY_MASTER": context.master_url,
            "CONVOY_LOG_FILE": str(log_path),
            **context.agent_env,
            ADDRESSES_FILE_ENV: str(addresses_file(context.run_dir, context.node_id)),
            PREEMPT_FILE_ENV: str(preempt_file(context.run_dir, assignment.role, assignment.rank,
                                               assignment.incarnation)),
            **service_env(context.job_token, context.host, context.tls),
            **({LEASE_ENV: context.lease_file} if context.lease_file else {}),
            **(group_env(assignment.role, assignment.rank, assignment.world_size, assignment.group_round, context.host,
                         port, assignment.group_address) if assignment.group_round else {}),
        }
