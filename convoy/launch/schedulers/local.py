"""The local scheduler: the master and each node's agent are child processes on this host.

In a job of roles, each agent's fork server (``convoy/agent/forked.py``) is started here, before the master and
the agent: its import of torch is the longest step before the first role process, and the agent, itself still
starting, takes it over (``--fork-server FD:PID``)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

from convoy import log
from convoy.agent.env import spawn_env
from convoy.agent.forked import launch_server, server_env
from convoy.config import JobConfig
from convoy.control.pool.store import pool_path
from convoy.procs import die_with_parent, signal_name

CONVOY = [sys.executable, "-m", "convoy"]


def agent_args(config: JobConfig, master: str, node_id: str, host: str | None, node_rank: int = -1,
               cpus: int = 0) -> list[str]:
    """``convoy agent``'s arguments for a node of this job, the script and its arguments last (not its token
    file: each scheduler gets the token to the node its own way). ``host``: the address its workers reach it at
    (None: the agent finds its own); ``cpus``: the CPUs it offers role processes (0: its CPU affinity)."""
    workers = config.workers
    return [
        "--master", master, "--run-dir", str(config.master.run_dir), "--node-id", node_id,
        *(["--host", host] if host else []),
        "--nproc-per-node", str(workers.nproc_per_node), "--stop-grace", str(workers.stop_grace_s),
        "--preload", ",".join(workers.preload),
        *(["--job-id", config.master.job_id] if config.master.job_id else []),
        "--role-name", workers.role_name, "--log-dir", workers.log_dir, "--redirects", workers.redirects,
        "--tee", workers.tee, "--local-ranks-filter", workers.local_ranks_filter,
        "--master-port", str(workers.master_port), *(["--no-python"] if workers.no_python else []),
        *(["--node-rank", str(node_rank)] if node_rank >= 0 else []), *(["--cpus", str(cpus)] if cpus else []),
        *(["-m", workers.entrypoint] if workers.module else [workers.entrypoint]), *workers.args,
    ]


class NodeScheduler(Protocol):
    """What ``convoy run`` asks of whatever places a job's master and nodes (``local``, ``ray``)."""

    config: JobConfig
    master_host: str
    port: int

    def where(self) -> str:
        """Where the nodes run, for the job's first line."""

    def start(self) -> None:
        """Start the master and the first nodes."""

    def tick(self) -> None:
        """Called about every 50 ms while the job runs: place what has become placeable."""

    def start_master(self, resume: bool) -> None: ...

    def master_exit(self) -> int | None: ...

    def newly_exited(self) -> list[tuple[str, int]]:
        """Agents that exited since the last call, with their exit codes."""

    def describe(self, code: int) -> str:
        """An agent's exit code in words."""

    def relaunch(self, node_id: str) -> str:
        """Bring a node's agent back (or let it be placed again); what was done, in words."""

    def running(self) -> list[str]: ...

    def node_ids(self) -> list[str]:
        """Every node this scheduler started an agent for."""

    def wait(self, timeout: float) -> bool: ...

    def stop(self, grace_s: float) -> None: ...


def describe_exit(returncode: int) -> str:
    name = signal_name(returncode)
    return f"killed by {name}" if name else f"exit code {returncode}"


class LocalScheduler:
    """Starts the master and the agents; all of them get SIGTERM if the launcher dies."""

    def __init__(self, config: JobConfig, token_file: Path, port: int, master_host: str = "127.0.0.1",
                 listener: socket.socket | None = None, agent_host: str | None = "127.0.0.1",
                 master_dies_by: int = signal.SIGTERM) -> None:
        """``master_host:port``: where the master listens (``listener``: already bound there, handed to it);
        ``agent_host``: the address agents give their workers (None: each finds its own towards the master);
        ``master_dies_by``: the signal the master gets if this launcher dies (SIGTERM ends the job; SIGKILL leaves
        its state for a master started again, where the agents outlive the launcher)."""
        self.config, self.token_file, self.port = config, token_file, port
        self.master_dies_by = master_dies_by
        self.master_host, self.listener, self.agent_host = master_host, listener, agent_host
        self.master: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.fork_servers: list[subprocess.Popen[bytes]] = []
        """Each agent's, started here; reaped here once its agent is done with it (they exit on their own)."""
        self._fork_pids: dict[str, int] = {}
        self._reported: dict[int, subprocess.Popen[bytes]] = {}
        """pid -> the exited agent reported for it; holding the object keeps its identity unique."""

    def where(self) -> str:
        return f"{self.config.num_agents} nodes"

    def start(self) -> None:
        """The fork servers (their import of torch first), the master, then an agent per node."""
        nodes = [f"local{index}" for index in range(self.config.num_agents)]
        fork_servers = self.start_fork_servers(nodes)
        self.start_master(resume=False)
        for node_id in nodes:
            self.start_node(node_id, fork_servers.get(node_id))

    def tick(self) -> None:
        return None

    def describe(self, code: int) -> str:
        return describe_exit(code)

    def relaunch(self, node_id: str) -> str:
        self.start_node(node_id)
        return "relaunching it"

    def node_ids(self) -> list[str]:
        return list(self.agents)

    def start_fork_servers(self, node_ids: list[str]) -> dict[str, socket.socket]:
        """A fork server for each node, before anything else starts, so that its import of torch overlaps the start
        of the master and the agents: a job of roles' (``role_preload``, tagged with the job and the node), else the
        workers' (``--preload``, the environment the agent would give it; none for ``--no-python`` or an empty
        list). None where it cannot start: the agent then starts its own. Node -> the socket's end its agent takes
        over."""
        workers = self.config.workers
        if self.config.roles:
            preload = workers.role_preload()
        elif workers.preload and not workers.no_python:
            preload = workers.preload
        else:
            return {}
        ends = {}
        for node_id in node_ids:
            env = server_env("127.0.0.1", self.config.master.job_id, node_id) if self.config.roles else \
                spawn_env(workers.nproc_per_node)
            try:
                proc, ends[node_id] = launch_server(preload, env, die_with_us=False)
            except OSError:
                continue
            self.fork_servers.append(proc)
            self._fork_pids[node_id] = proc.pid
        return ends

    def start_master(self, resume: bool) -> None:
        master = self.config.master
        run_dir = str(master.run_dir)
        if resume:
            args = ["--resume", run_dir]
        else:
            rdzv = master.rendezvous
            args = ["--host", self.master_host, "--port", str(self.port), "--run-dir", run_dir,
                    "--nnodes", f"{rdzv.min_nodes}:{rdzv.max_nodes}", "--max-restarts", str(master.max_restarts),
                    "--rdzv-wait", str(rdzv.wait_s), "--join-timeout", str(rdzv.join_timeout_s),
                    "--heartbeat-timeout", str(master.heartbeat_timeout_s), "--job-id", master.job_id,
                    "--max-regroups", str(master.max_regroups), "--regroup-window", str(master.regroup_window_s),
                    "--auto-apply", ",".join(master.auto_apply), "--priority", str(master.priority),
                    "--preempt-grace", str(master.preempt_grace_s), "--peer-loss-wait", str(master.peer_loss_wait_s),
                    # this machine's CPU pool holds a job whose nodes are all here, not one that Ray places
                    *(["--pool", str(pool_path())] if self.config.scheduler == "local" else [])]
            for key, value in master.train_overrides.items():
                args += ["--set", f"{key}={value}"]
        fds: tuple[int, ...] = ()
        if self.listener is not None:
            fds = (self.listener.fileno(),)
            args += ["--listen-fd", str(fds[0])]
        self.master = self._spawn(["master", *args, "--token-file", str(self.token_file), "--under-run"], fds,
                                  self.master_dies_by)

    def start_node(self, node_id: str, fork_server: socket.socket | None = None, node_rank: int = -1) -> None:
        """Start the node's agent; ``fork_server``: its fork server's end (closed here once the agent holds it);
        ``node_rank``: the rank it asks for in a first round (-1: none)."""
        command = ["agent", "--token-file", str(self.token_file),
                   *agent_args(self.config, f"{self.master_host}:{self.port}", node_id, self.agent_host, node_rank)]
        passed: tuple[int, ...] = ()
        if fork_server is not None:
            passed = (fork_server.fileno(),)
            command[1:1] = ["--fork-server", f"{fork_server.fileno()}:{self._fork_pids[node_id]}"]
        try:
            self.agents[node_id] = self._spawn(command, passed)
        finally:
            if fork_server is not None:
                fork_server.close()  # the agent's now: the server ends once the agent closes it, or dies
        self.fork_servers = [proc for proc in self.fork_servers if proc.poll() is None]

    def _spawn(self, args: list[str], fds: tuple[int, ...] = (), dies_by: int = signal.SIGTERM
               ) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(CONVOY + args, pass_fds=fds, preexec_fn=lambda: die_with_parent(dies_by))
        log.debug(f"convoy: started convoy {args[0]} (pid {proc.pid})")
        return proc

    def master_exit(self) -> int | None:
        return None if self.master is None else self.master.poll()

    def _master_running(self) -> bool:
        return self.master is not None and self.master.poll() is None

    def running(self) -> list[str]:
        return [node_id for node_id, proc in self.agents.items() if proc.poll() is None]

    def newly_exited(self) -> list[tuple[str, int]]:
        """Agents that exited since the last call, with their exit codes."""
        exited = []
        for node_id, proc in self.agents.items():
            if proc.poll() is not None and self._reported.get(proc.pid) is not proc:
                self._reported[proc.pid] = proc
                exited.append((node_id, proc.returncode))
        return exited

    def wait(self, timeout: float) -> bool:
        """Wait for every child to exit; False if some are still running at the deadline."""
        deadline = time.monotonic() + timeout
        while (self.running() or self._master_running()) and time.monotonic() < deadline:
            time.sleep(0.02)
        done = not self.running() and not self._master_running()
        if done:  # each fork server ends as its agent's end of the socket closes
            while any(proc.poll() is None for proc in self.fork_servers) and time.monotonic() < deadline:
                time.sleep(0.02)
        return done and all(proc.poll() is not None for proc in self.fork_servers)

    def stop(self, grace_s: float) -> None:
        """SIGTERM every child (agents stop their workers), SIGKILL any still there after the grace period."""
        children = [proc for proc in [self.master, *self.agents.values()] if proc is not None]
        for proc in children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        if not self.wait(grace_s):
            for proc in [*children, *self.fork_servers]:  # a fork server kills what it forked as it dies
                if proc.poll() is None:
                    proc.kill()
        for proc in [*children, *self.fork_servers]:
            proc.wait()
