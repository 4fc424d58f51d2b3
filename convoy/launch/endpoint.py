"""``convoy run --endpoint HOST:PORT`` (torchrun's ``--rdzv-endpoint``, several nodes): one command on every host.

The first launcher to bind HOST:PORT (on the host that has that address) claims the endpoint: it serves the job's
master there and runs this host's node; every other launcher runs its host's node as an agent that joins that
master. The bound socket is handed to the master, and the launcher keeps it, so no other process can take the port
between the claim and the master's start, nor while a killed master is started again. A master started by hand on
the endpoint (``convoy master --host HOST --port PORT``) makes every launcher a joiner.

The token: ``--join-token`` (torchrun's ``--rdzv-conf token=...``), the same on every host; or the token file of a
run dir the hosts share (``--token-file``, default ``RUN_DIR/token``), which the claimer writes and a joiner waits
for. Each launcher holds its node's id (``HOST-SLOT``) for its life (a lock in a folder of the endpoint's on the
host), so a relaunched agent is the same node.
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from convoy.agent.agent_config import default_node_id
from convoy.agent.reap import reap
from convoy.config import JobConfig
from convoy.control.limits import Limits
from convoy.control.store import read_status
from convoy.control.token import TOKEN_FILE, read_token, write_token
from convoy.errors import ConfigError
from convoy.launch.run import CHILD_EXIT_GRACE_S, EXIT_USAGE, POLL_S, abort_job, describe_exit, report_lost, supervise
from convoy.launch.schedulers.local import LocalScheduler
from convoy.procs import Interrupted, raise_interrupted
from convoy.shm import remove_segments

if TYPE_CHECKING:
    from convoy.control.protocol.client import MasterClient


def claim(host: str, port: int) -> socket.socket | None:
    """A socket bound and listening on ``host:port``: the endpoint is this launcher's. None: another process
    listens there, or ``host`` is not an address of this host."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=Limits().backlog)
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return None
        raise ConfigError(f"--endpoint {host}:{port}: cannot listen there ({exc.strerror})") from exc
    except socket.gaierror as exc:
        raise ConfigError(f"--endpoint {host}:{port}: cannot resolve {host!r} ({exc}): check the name") from None


def run_endpoint_job(config: JobConfig, endpoint: tuple[str, int], token: str, token_file: Path | None,
                     relaunch: bool, console: Callable[[str], None] = print, node_rank: int = -1,
                     agent_host: str | None = None) -> int:
    """Run this host's node of the job at ``endpoint`` (and its master, if this launcher claims it);
    ``node_rank``: the rank this node asks for in the first round (torchrun's --node-rank); ``agent_host``: the
    address the other hosts reach this one at (torchrun's --local-addr; None: the one towards the master)."""
    if node_rank != -1 and not 0 <= node_rank < config.master.rendezvous.max_nodes:
        raise ConfigError(f"--node-rank {node_rank}: give 0..{config.master.rendezvous.max_nodes - 1} (--nnodes "
                          f"is {config.master.rendezvous.max_nodes} at most)")
    if config.roles:
        raise ConfigError("--endpoint runs a job of one script on several hosts; a job of roles starts its nodes "
                          "with `convoy master` and `convoy agent` on each host")
    config.validate()  # creates the run dir: after the checks that need none
    host, port = endpoint
    run_dir = config.master.run_dir
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    listener = claim(host, port)
    node_id = default_node_id(_slots_dir(host, port, run_dir))  # held for this launcher's life, relaunches included
    shared = token_file or run_dir / TOKEN_FILE
    private: Path | None = None
    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if listener is not None:
            return _serve(config, listener, shared, token, (node_id, node_rank), relaunch, console, agent_host)
        private = run_dir / "nodes" / f"token-{node_id}" if token else None
        scheduler = LocalScheduler(config, private or shared, port, master_host=host, agent_host=agent_host)
        fork_server = scheduler.start_fork_servers([node_id]).get(node_id)  # imports torch while the token comes
        try:
            if private is not None:
                private.parent.mkdir(mode=0o700, exist_ok=True)
                private.unlink(missing_ok=True)  # a predecessor's, killed before it could remove it
                write_token(private, token)
            else:
                _wait_for_token(shared, config.master.rendezvous.join_timeout_s, endpoint)
        except BaseException:
            if fork_server is not None:
                fork_server.close()
            scheduler.stop(CHILD_EXIT_GRACE_S)
            raise
        return _join(config, scheduler, fork_server, endpoint, (node_id, node_rank), relaunch, console)
    except Interrupted as exc:
        return exc.exit_code
    finally:
        if private is not None:
            private.unlink(missing_ok=True)
        if listener is not None:
            listener.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(config: JobConfig, listener: socket.socket, token_path: Path, token: str, node: tuple[str, int],
           relaunch: bool, console: Callable[[str], None], agent_host: str | None = None) -> int:
    """This launcher claimed the endpoint: the master, this host's agent, and the job's outcome."""
    node_id, node_rank = node
    master = config.master
    host, port = listener.getsockname()[:2]
    master.job_id = master.job_id or secrets.token_hex(4)
    job_token = write_token(token_path, token or None)
    scheduler = LocalScheduler(config, token_path, port, master_host=host, listener=listener, agent_host=agent_host)
    fork_server = scheduler.start_fork_servers([node_id]).get(node_id)  # its import of torch first
    from convoy.control.protocol.client import MasterClient  # pydantic's models: once the server is on its way

    started = time.monotonic()
    rdzv = master.rendezvous
    console(f"convoy: job {master.job_id}: this host claimed {host}:{port} and serves the master there; "
            f"{rdzv.min_nodes}:{rdzv.max_nodes} nodes, {config.workers.nproc_per_node} workers here (node {node_id}), "
            f"run dir {master.run_dir}")
    if not token:
        console(f"convoy: the other hosts join with the same command and the token file {token_path} (a shared "
                "run dir, --token-file, or --rdzv-conf token=...)")
    client = MasterClient(host, port, job_token, give_up_after_s=2.0)
    try:
        scheduler.start_master(resume=False)
        scheduler.start_node(node_id, fork_server, node_rank=node_rank)
        code = supervise(scheduler, client, relaunch, 0, console)  # the other nodes are not this launcher's
        if not scheduler.wait(config.workers.stop_grace_s + CHILD_EXIT_GRACE_S):
            scheduler.stop(CHILD_EXIT_GRACE_S)
        job = read_status(master.run_dir, recent=0)["job"]
        console(f"convoy: finished in {time.monotonic() - started:.1f} s with {job['restart_count']} restart(s)")
        return code
    except Interrupted:
        abort_job(client, "the launcher that serves the master was interrupted")
        scheduler.stop(config.workers.stop_grace_s + CHILD_EXIT_GRACE_S)
        raise
    finally:
        scheduler.stop(CHILD_EXIT_GRACE_S)
        reap(master.job_id, node_id)
        remove_segments(master.job_id)


def _join(config: JobConfig, scheduler: LocalScheduler, fork_server: socket.socket | None,
          endpoint: tuple[str, int], node: tuple[str, int], relaunch: bool, console: Callable[[str], None]) -> int:
    """Another process serves the endpoint: run this host's agent (``fork_server``: the one started for it) until
    the job ends for it."""
    from convoy.control.protocol.client import MasterClient

    node_id, node_rank = node
    host, port = endpoint
    client = MasterClient(host, port, read_token(scheduler.token_file), give_up_after_s=2.0)
    console(f"convoy: joining the master at {host}:{port} as node {node_id} ({config.workers.nproc_per_node} "
            f"workers), run dir {config.master.run_dir}")
    try:
        scheduler.start_node(node_id, fork_server, node_rank=node_rank)
        return _follow(scheduler, client, node_id, relaunch, console)
    except Interrupted:
        scheduler.stop(config.workers.stop_grace_s + CHILD_EXIT_GRACE_S)  # the agent leaves the job as it stops
        raise
    finally:
        scheduler.stop(CHILD_EXIT_GRACE_S)
        if config.master.job_id:
            reap(config.master.job_id, node_id)


def _follow(scheduler: LocalScheduler, client: MasterClient, node_id: str, relaunch: bool,
            console: Callable[[str], None]) -> int:
    """The agent's outcome: 0 (the job succeeded) or 1 (it failed), after relaunches of a killed agent."""
    while True:
        for _, code in scheduler.newly_exited():
            if code in (0, 1):
                console(f"convoy: node {node_id} done: the job {'succeeded' if code == 0 else 'failed'}")
                return code
            if code == EXIT_USAGE:
                return code  # refused (a wrong token, excluded): its own line said why
            report_lost(client, node_id, describe_exit(code))
            if not relaunch:
                console(f"convoy: agent of node {node_id} {describe_exit(code)}; not relaunched (--relaunch is off)")
                return 1
            console(f"convoy: agent of node {node_id} {describe_exit(code)}; relaunching it")
            scheduler.start_node(node_id)
        time.sleep(POLL_S)


def _slots_dir(host: str, port: int, run_dir: Path) -> Path:
    """Where this host's launchers of the job at ``host:port`` take their node slots: one folder per endpoint on
    the host, so that two of them get two node ids even with run dirs of their own (the run dir where the
    folder is another user's)."""
    folder = Path(tempfile.gettempdir()) / f"convoy-{os.getuid()}-endpoint-{host.strip('[]')}-{port}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        if folder.is_symlink() or folder.stat().st_uid != os.getuid():
            return run_dir
    except OSError:
        return run_dir
    return folder


def _wait_for_token(path: Path, timeout_s: float, endpoint: tuple[str, int]) -> None:
    """A joiner without ``--join-token`` takes the claimer's token file from the shared run dir, once written."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if path.read_text().strip():
                return
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise ConfigError(f"token file {str(path)!r} cannot be read: {exc.strerror}") from exc
        if time.monotonic() >= deadline:
            raise ConfigError(f"{endpoint[0]}:{endpoint[1]} is served by another process, and no token came to "
                              f"{path} within {timeout_s:.0f} s: give the job's token with --rdzv-conf token=... "
                              "(or --join-token), or its token file with --token-file")
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

