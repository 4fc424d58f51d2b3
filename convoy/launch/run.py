"""``convoy run``: the local default, a master and N agents as child processes of this launcher.

The launcher watches them: a master that dies is started again from its state in the run
dir (agents reattach, workers keep training); an agent that dies is reported to the master
at once, and started again with ``--relaunch``.
"""

from __future__ import annotations

import secrets
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from convoy.agent.gpus import check_local_gpus
from convoy.agent.reap import reap
from convoy.config import STATE_FILE, JobConfig
from convoy.control.store import read_status
from convoy.control.token import TOKEN_FILE, write_token
from convoy.errors import ConfigError, ConvoyError
from convoy.launch.schedulers.local import LocalScheduler, NodeScheduler, describe_exit
from convoy.ports import free_port, unclaimed_port
from convoy.procs import Interrupted, ignore_interrupts, raise_interrupted
from convoy.shm import remove_segments

if TYPE_CHECKING:
    from convoy.control.protocol.client import MasterClient

CHILD_EXIT_GRACE_S = 5.0
MAX_MASTER_RESTARTS = 5
EXIT_USAGE = 2
POLL_S = 0.05
MASTER_END_WAIT_S = 1.0


def run_local_job(config: JobConfig, relaunch: bool = False, console: Callable[[str], None] = print,
                  agent_host: str = "127.0.0.1") -> int:
    """Run the job to its end; return 0 on success, 1 on failure, 128+N on signal N. ``agent_host``: the address
    the workers reach their node at (MASTER_ADDR; torchrun's --local-addr)."""
    config.validate()
    check_local_gpus([(role.name, role.gpus) for role in config.roles])  # every node of this job is this host
    port, token_file, token = prepare_job(config, "127.0.0.1")
    return run_job(LocalScheduler(config, token_file, port, agent_host=agent_host), token, relaunch, console)


def prepare_job(config: JobConfig, master_host: str) -> tuple[int, Path, str]:
    """The job's id, its master's port on ``master_host`` and its token (written in the run dir)."""
    config.master.job_id = config.master.job_id or secrets.token_hex(4)
    port = _usable_port(config.master.port, master_host)
    token_file = config.master.run_dir / TOKEN_FILE
    config.workers.role_groups = any(role.group for role in config.roles)  # their fork servers preload DDP's imports
    return port, token_file, write_token(token_file)


def run_job(scheduler: NodeScheduler, token: str, relaunch: bool, console: Callable[[str], None]) -> int:
    """Start the job's master and nodes with ``scheduler`` and watch them to the job's end."""
    config = scheduler.config
    run_dir = config.master.run_dir
    client: MasterClient | None = None
    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    try:
        if config.roles:  # the master runs them; it ends the job when every role has finished
            from convoy.control.roles.roles_file import save_roles

            save_roles(run_dir, config.roles)
            roles = ", ".join(f"{role.name} x{role.count}" for role in config.roles)
            console(f"convoy: job {config.master.job_id}: roles {roles} on {scheduler.where()}, max restarts "
                    f"{config.master.max_restarts} per role, run dir {run_dir}")
        else:
            console(f"convoy: job {config.master.job_id}: {scheduler.where()} x "
                    f"{config.workers.nproc_per_node} workers, max restarts {config.master.max_restarts}, "
                    f"run dir {run_dir}")
        scheduler.start()
        from convoy.control.protocol.client import MasterClient  # pydantic: imported once the children are on their way

        client = MasterClient(scheduler.master_host, scheduler.port, token, give_up_after_s=2.0)
        master_code = supervise(scheduler, client, relaunch, config.master.rendezvous.min_nodes, console)
        if not scheduler.wait(config.workers.stop_grace_s + CHILD_EXIT_GRACE_S):
            scheduler.stop(CHILD_EXIT_GRACE_S)
        job = read_status(run_dir, recent=0)["job"]  # the outcome is the master's: its record may lag (a full disk)
        console(f"convoy: finished in {time.monotonic() - started:.1f} s with {job['restart_count']} restart(s)")
        ignore_interrupts()  # the job is over: a late signal must not cut the cleanup below short
        return master_code
    except Interrupted as exc:
        if client is not None:
            abort_job(client, f"interrupted by {exc}")  # the record names the launcher's signal
        scheduler.stop(config.workers.stop_grace_s + CHILD_EXIT_GRACE_S)
        return exc.exit_code
    finally:
        ignore_interrupts()
        try:
            scheduler.stop(CHILD_EXIT_GRACE_S)
            for node_id in scheduler.node_ids():
                reap(config.master.job_id, node_id)
        finally:  # even if stopping failed: the job's segments end with it
            remove_segments(config.master.job_id)  # in case an agent died before it could clean up
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def supervise(scheduler: NodeScheduler, client: MasterClient, relaunch: bool, min_nodes: int,
              console: Callable[[str], None]) -> int:
    """Watch the children until the master exits with the job's outcome (0 succeeded, 1 failed)."""
    master_restarts, aborted = 0, False
    while True:
        scheduler.tick()
        code = scheduler.master_exit()
        if code in (0, 1):
            return code
        if code is not None:
            if code == EXIT_USAGE or master_restarts >= MAX_MASTER_RESTARTS:
                raise ConvoyError(f"the master stopped {master_restarts + 1} time(s), last with {describe_exit(code)}; "
                                  "giving up (see the lines above)")
            master_restarts += 1
            has_state = (scheduler.config.master.run_dir / STATE_FILE).exists()
            console(f"convoy: master {describe_exit(code)}; restarting it" + (" from the run dir" if has_state else ""))
            scheduler.start_master(resume=has_state)
        for node_id, agent_code in scheduler.newly_exited():
            reap(scheduler.config.master.job_id, node_id)  # an agent killed outright leaves its workers' children
            if agent_code in (0, 1) and _master_ends(scheduler):
                continue  # it heard the job's end (a master on its way out would only be retried in vain)
            report_lost(client, node_id, scheduler.describe(agent_code))
            if relaunch and agent_code == EXIT_USAGE:  # refused (e.g. excluded): starting it again cannot help
                console(f"convoy: agent of node {node_id} exited with a usage error; not relaunching it")
            elif relaunch and agent_code != 0:
                console(f"convoy: agent of node {node_id} {scheduler.describe(agent_code)}; "
                        f"{scheduler.relaunch(node_id)}")
        running = len(scheduler.running())
        if running < min_nodes and not relaunch and not aborted:
            aborted = True  # nothing will bring a local node back: do not sit out the join timeout
            left = "every agent exited before the job ended" if running == 0 else f"only {running} node(s) left"
            abort_job(client, f"{left}, fewer than --nnodes MIN={min_nodes}, and --relaunch is off; see the lines "
                              "above")
        time.sleep(POLL_S)


def _master_ends(scheduler: NodeScheduler) -> bool:
    """Whether the master exits within a moment (an agent that exited 0 or 1 may have heard the job end)."""
    deadline = time.monotonic() + MASTER_END_WAIT_S
    while scheduler.master_exit() is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return scheduler.master_exit() in (0, 1)


def _usable_port(port: int, host: str) -> int:
    """``port`` if it is free on ``host`` (for 0, one that no outgoing connection takes before the master binds
    it); a clear error if it is taken."""
    if port == 0:
        return unclaimed_port(host)
    try:
        return free_port(host, port)
    except OSError as exc:
        raise ConfigError(f"port {port} on {host} is already in use: pick another --port or 0 for any") from exc


def report_lost(client: MasterClient, node_id: str, why: str) -> None:
    from convoy.control.protocol import messages as p

    try:
        client.call("/leave", p.LeaveRequest(node_id=node_id, reason=f"agent {why}"), p.Ack)
    except ConvoyError:
        pass  # the master is down or the job is over; it will learn from heartbeats


def abort_job(client: MasterClient, reason: str) -> None:
    from convoy.control.protocol import messages as p

    try:
        client.call("/abort", p.AbortRequest(reason=reason), p.Ack)
    except ConvoyError:
        pass
