"""The per-node agent: join -> start workers -> monitor -> report -> rejoin, until the job ends."""

from __future__ import annotations

import queue
import secrets
import signal
import socket
import time

from convoy import log
from convoy.agent.agent_config import AgentConfig
from convoy.agent.forked import ForkServer, fault_of, fork_server_for, start_fork_server
from convoy.agent.heartbeat import Heartbeat
from convoy.agent.local_api import ClientPool, LocalApi
from convoy.agent.log_pump import peer_lost
from convoy.agent.reap import NodeCgroup, reap
from convoy.agent.role_memory import RoleMemory, join_memory, send_event
from convoy.agent.role_procs import JobContext, RoleProcesses
from convoy.agent.workers import Worker, WorkerGroup
from convoy.control.protocol import messages as p
from convoy.control.protocol.client import MasterClient
from convoy.errors import ConvoyError, JobEndedError, MasterUnreachableError, WorkerStartError
from convoy.ports import hold_port, port_taken
from convoy.procs import Interrupted, raise_interrupted, signal_name
from convoy.shm import remove_segments
from convoy.worker.lease import LeaseWriter, lease_path

POLL_S = 0.02
PRELOAD_WAIT_S = 120.0
EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2


class Agent:
    """One node of a job. ``run()`` returns the agent's exit code."""

    def __init__(self, config: AgentConfig, group: WorkerGroup | None = None, forks: ForkServer | None = None) -> None:
        self.config = config
        self.client = MasterClient(config.master_host, config.master_port, config.token, config.master_timeout_s,
                                   config.tls_ca)
        self.group = group or WorkerGroup(config.workers, config.run_dir, host=config.host)
        self.heartbeat = Heartbeat(config)
        self.client.ended = self.heartbeat.heard_end
        self.master_url = f"{config.master_host}:{config.master_port}"
        self._final_status = ""
        self._job_id = ""
        self._instance = secrets.token_hex(8)
        self._asked_at = 0.0
        self._held_port: socket.socket | None = None
        self._wanted_port = config.workers.master_port
        """Bound to the port this node offered as MASTER_PORT, from its join until its workers start."""
        self._spare_port: socket.socket | None = None
        """Bound to the port this node offers for the round after the one it runs (``WaitRequest.next_port``)."""
        self._last_round = 0
        self._role_processes: RoleProcesses | None = None
        self._forks = forks  # the role processes' fork server (``convoy agent`` may have started it)
        if forks is not None:
            forks.node_id = config.node_id
        self.group.name_node(config.node_id)
        self.local_api = LocalApi(ClientPool(lambda: MasterClient(
            config.master_host, config.master_port, config.token, config.master_timeout_s, config.tls_ca)).forward)
        """The node's processes reach the master through it (data shards); they hold no job token."""
        self.group.agent_env = self.local_api.env()

    def run(self) -> int:
        previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.local_api.start()
            if not self.config.roles:
                self.group.fill_standbys()  # import torch while the round assembles
            return self._loop()
        except Interrupted as exc:
            self._leave(f"interrupted by {exc}")
            return exc.exit_code
        except JobEndedError:  # a report of the last moments, to a master that has closed the job's books
            self._final_status = self.heartbeat.latest.job_status if self.heartbeat.latest else "failed"
            return self._job_exit_code()
        except MasterUnreachableError as exc:
            log.warning(f"convoy agent {self.config.node_id}: {exc}; stopping workers")
            return EXIT_FAILED
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                self._stop_everything()
            finally:  # even if a step above failed: nothing of the job is left running or in /dev/shm
                reap(self._job_id, self.config.node_id)  # what the workers forked, and the node's cgroup
                if self._job_id:  # the job's in-memory snapshots end with it; a node leaving a job that goes on
                    remove_segments(self._job_id, "" if self._final_status else self.config.node_id)  # takes its own
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    def _stop_everything(self) -> None:
        self.heartbeat.stopping.set()
        self._revoke()
        self._release_port(spare=True)
        if self._role_processes is not None:  # unreported: the node has left (the master counted its
            self._role_processes.stop_all()    # processes out) or cannot reach the master
        if self._forks is not None:
            self._forks.close()  # no process of the job is forked from it any more
        self.group.close()
        self.local_api.stop()
        if self.heartbeat.lease is not None:
            self.heartbeat.lease.close()

    def _loop(self) -> int:
        while True:
            round_info = self._rendezvous()
            if round_info is None:
                return self._job_exit_code()
            ended = self._run_roles(round_info) if round_info.roles else self._run_round(round_info)
            if ended:
                return self._job_exit_code()

    def _rendezvous(self) -> p.RoundInfo | None:
        """Join and wait for the round to close; None when the job has ended.

        The node joins once its fork server (or its standbys) has preloaded, so a round never waits on a cold
        import of another node's workers (a node that joins a running job costs it no idle time).
        """
        if not self.config.roles:
            self.group.wait_preloaded(PRELOAD_WAIT_S)
        round_id = self._carried_round()
        while True:
            if not round_id:
                join = p.JoinRequest(node_id=self.config.node_id, host=self.config.host, port=self._hold_port(),
                                     nproc=self.config.workers.nproc_per_node, instance=self._instance,
                                     node_rank=self.config.node_rank, **join_memory(self.config.cpus))
                joined = self.client.call("/join", join, p.JoinResponse)
                if not self._job_id:
                    self._first_joined(joined.job_id)
                round_id, self._job_id = joined.round_id, joined.job_id
                log.debug(f"convoy agent {self.config.node_id}: joined job {self._job_id}; waiting for round "
                          f"{round_id}")
            self._open_lease()
            if not self.heartbeat.is_alive() and not self.heartbeat.stopping.is_set():
                self.heartbeat.start()
            while True:
                poll = self.heartbeat.poll_s or self.config.heartbeat_s  # as long as the master asks of heartbeats
                wait = p.WaitRequest(node_id=self.config.node_id, round_id=round_id, timeout_s=poll,
                                     next_port=self._offer_next_port())
                self._asked_at = time.monotonic()
                reply = self.client.call("/wait", wait, p.WaitResponse, wait_s=wait.timeout_s)
                if reply.state == "waiting":  # a master that answered early: the rest of the poll is waited out here
                    time.sleep(max(0.0, wait.timeout_s - (time.monotonic() - self._asked_at)))
                if reply.state == "ready":
                    return reply.round
                if reply.state == "ended":
                    self._final_status = reply.job_status
                    return None
                if reply.state == "rejoin":
                    round_id = 0
                    break

    def _carried_round(self) -> int:
        """The round that followed this node's last one, if the node offered a port for it: the master may have
        placed it there at once (a regroup of the same nodes), and it waits for that round without a join (the
        master answers "rejoin" where it did not). 0: the node joins."""
        latest = self.heartbeat.latest
        if self._spare_port is None or not self._last_round or latest is None or latest.round_id <= self._last_round:
            return 0
        self._release_port()
        self._held_port, self._spare_port = self._spare_port, None  # what the master was offered is MASTER_PORT now
        return latest.round_id

    def _offer_next_port(self) -> int:
        """A port held from now on for the round after the one this node waits for (0: none; a job of roles
        serves no round store)."""
        if self.config.roles:
            return 0
        if self._spare_port is None:
            try:
                self._spare_port = hold_port(listen=self.group.uses_round_store)
            except OSError as exc:  # no free port now: the node joins the next round as usual
                log.debug(f"convoy agent {self.config.node_id}: no port to offer for the next round: {exc}")
                return 0
        return int(self._spare_port.getsockname()[1])

    def _run_round(self, round_info: p.RoundInfo) -> bool:
        """Run this node's workers until the round ends; True when the whole job has ended."""
        member = next(m for m in round_info.members if m.node_id == self.config.node_id)
        self._last_round = round_info.round_id
        reported_failure = reported_done = start_failed = False
        if self.heartbeat.lease is not None and round_info.lease_s > 0:
            self.heartbeat.lease.grant(round_info.round_id, self._asked_at, round_info.lease_s)
            self.heartbeat.running = round_info
        log.debug(f"convoy agent {self.config.node_id}: round {round_info.round_id}: starting {member.nproc} "
                  f"worker(s), ranks {member.rank_offset}..{member.rank_offset + member.nproc - 1} of "
                  f"{round_info.world_size}")
        try:
            store = None
            if member.rank_offset == 0 and self.group.uses_round_store:
                store, self._held_port = self._held_port, None  # rank 0 serves the round's store on it
            self._release_port()  # else rank 0 binds it from now on
            self.group.start(round_info, member, self.master_url, store)
        except WorkerStartError as exc:
            log.warning(f"convoy agent {self.config.node_id}: {exc}")
            report = p.WorkerExit(node_id=self.config.node_id, round_id=round_info.round_id, rank=member.rank_offset,
                                  local_rank=0, start_failed=True, log_tail=[str(exc)])
            self.client.call("/worker_exit", report, p.Ack)
            reported_failure = reported_done = start_failed = True
        while True:
            if self.heartbeat.error is not None:
                raise self.heartbeat.error
            latest = self.heartbeat.latest
            if latest is not None and latest.job_status != "running":
                self._final_status = latest.job_status
                self._revoke()
                self.group.stop()
                return True
            if latest is not None and latest.round_id > round_info.round_id:
                log.debug(f"convoy agent {self.config.node_id}: round {round_info.round_id} ended (round "
                          f"{latest.round_id} is next): stopping its workers")
                self._revoke()  # before the stop: from now on no worker of this round writes state
                self.group.stop()
                return False
            done, failed = self.group.poll()
            if failed and not reported_failure:
                reported_failure = True
                first = min(failed, key=lambda w: ((w.returncode or 0) >= 0, w.rank))  # a killed one before its peers
                self._report_failure(round_info, first)
            elif len(done) == len(self.group.workers) and not reported_done:
                reported_done = True
                for worker in done:
                    worker.pump.join(timeout=2.0)  # their last lines, events and drop counts are read (bounded)
                self._forward_events(round_info, most=1000)  # before the job can end on this report
                self.client.call("/node_done", p.NodeDone(node_id=self.config.node_id, round_id=round_info.round_id),
                                 p.Ack)
            self._forward_events(round_info)
            if not start_failed:
                self.group.refill_when_idle(now=self.heartbeat.restart_coming.is_set())
                self.heartbeat.restart_coming.clear()
            self.heartbeat.changed.wait(POLL_S)
            self.heartbeat.changed.clear()

    def _run_roles(self, round_info: p.RoundInfo) -> bool:
        """A job of roles: run the processes the master assigns until the job ends. Its rounds only gather the
        nodes (the roles share no torch.distributed world): on a new one (a node lost or added) the node joins
        it and its processes go on, under a lease each heartbeat renews for the job's current round."""
        round_id = round_info.round_id
        self._release_port()
        self.group.close()  # no worker per local rank: the workers' fork server is not needed
        self._start_fork_server(self._job_id)
        lease = self.heartbeat.lease if round_info.lease_s > 0 else None
        if lease is not None:
            self.heartbeat.across_rounds, self.heartbeat.running = True, round_info
            lease.grant(round_id, self._asked_at, round_info.lease_s)
        context = JobContext(self._job_id, self.config.node_id, self.config.host, self.config.run_dir, self.master_url,
                             self.local_api.env(), job_token=self.config.token, tls=bool(self.config.tls_ca),
                             lease_file=str(lease.path) if lease is not None else "")
        memory = RoleMemory(self.config.node_id)
        processes = self._role_processes = RoleProcesses(self.config.workers, context, self.group.cgroup,
                                                         memory=memory, forks=self._forks,
                                                         fresh_forks=self._fresh_fork_server)
        while True:
            if self.heartbeat.error is not None:
                raise self.heartbeat.error
            latest = self.heartbeat.latest
            if latest is not None and latest.job_status != "running":
                self._final_status = latest.job_status
                processes.stop_all()  # their exits are not sent: the job's books are closed, nothing is decided
                return True
            self._carry_out_orders(processes)  # (first: a process moved here starts before the node rejoins)
            if latest is not None and latest.round_id > round_id:
                # the master places the nodes that stay at once (Rendezvous.carry_all): a member asks no place
                wait = p.WaitRequest(node_id=self.config.node_id, round_id=latest.round_id, timeout_s=0)
                placed = self.client.call("/wait", wait, p.WaitResponse).state == "ready"
                round_id = latest.round_id if placed else self._join_roles_round(latest.round_id)
            for _, report in processes.poll():
                memory.send(self.client, round_id)  # a measurement the process finished goes first
                self.client.call("/role_report", report, p.Ack)
            memory.send(self.client, round_id)
            self.heartbeat.changed.wait(POLL_S)
            self.heartbeat.changed.clear()

    def _join_roles_round(self, newest: int) -> int:
        join = p.JoinRequest(node_id=self.config.node_id, host=self.config.host, port=self._hold_port(),
                             nproc=self.config.workers.nproc_per_node, instance=self._instance,
                             **join_memory(self.config.cpus))
        self._release_port()  # no torch.distributed store runs on it
        joined = self.client.call("/join", join, p.JoinResponse)
        # the round it joined may be a later one (a lost node coming back grows the job): joining that one
        # again once it runs would read as an agent that restarted, and restart the job
        return max(newest, joined.round_id)

    def _carry_out_orders(self, processes: RoleProcesses) -> None:
        """What the master's replies asked, each start reported."""
        while True:
            try:
                assignments, stops = self.heartbeat.orders.get_nowait()
            except queue.Empty:
                return
            for report in processes.carry_out(assignments, stops):
                self.client.call("/role_report", report, p.Ack)

    def _fresh_fork_server(self) -> ForkServer | None:
        """A fresh fork server for the role processes, in place of one that failed (``RoleProcesses`` closes that
        one); None where it cannot start."""
        self._forks = start_fork_server(self.config.workers, self.config.host, self._job_id, self.config.node_id)
        if self._forks is not None and self.group.cgroup is not None:
            self.group.cgroup.add(self._forks.pid)
        return self._forks

    def _start_fork_server(self, job_id: str) -> None:
        """The role processes' fork server, once per agent: its import of torch overlaps the rest of the start."""
        self._forks = fork_server_for(self._forks, self.config.workers, self.config.host, job_id, self.config.node_id)
        if self._forks is not None and self.group.cgroup is not None:
            self.group.cgroup.add(self._forks.pid)  # what it forks is born in the node's cgroup

    def _forward_events(self, round_info: p.RoundInfo, most: int = 20) -> None:
        """Send the master what the workers recorded (a few per pass: training comes first)."""
        for _ in range(most):
            try:
                rank, kind, message = self.group.events.get_nowait()
            except queue.Empty:
                return
            send_event(self.client, p.WorkerEvent(node_id=self.config.node_id, round_id=round_info.round_id,
                                                  rank=max(rank, 0), kind=kind, message=message[:4096]))

    def _report_failure(self, round_info: p.RoundInfo, worker: Worker) -> None:
        code = worker.returncode or 0
        killed = signal_name(code)
        self.group.failures.claim(worker.rank, f"rank {worker.rank} " + (f"was killed by {killed}" if killed else
                                                                         f"exited with code {code}"))
        worker.signal(signal.SIGKILL)  # what it left in its group goes now (the round stops anyway): the pipe
        worker.pump.join(timeout=2.0)  # closes, and its last lines reach the log file and the tail (bounded)
        self._forward_events(round_info, most=1000)
        report = p.WorkerExit(
            node_id=self.config.node_id, round_id=round_info.round_id, rank=worker.rank,
            local_rank=worker.local_rank, exitcode=code if code >= 0 else None, signal=signal_name(code),
            log_path=worker.pump.log_path, log_tail=list(worker.pump.tail),
            port_in_use=worker.rank == 0 and port_taken(worker.pump.tail), infrastructure=fault_of(worker.proc),
            peer_lost=code > 0 and peer_lost(worker.pump.tail),
        )
        self.client.call("/worker_exit", report, p.Ack)

    def _hold_port(self) -> int:
        """Hold a fresh port for this join (the one held for an earlier join is let go). Where rank 0 will serve
        the round's store on it, it listens from now on: a rank that reaches the store before rank 0 has started
        waits in the queue instead of being refused (``round_store.py``)."""
        self._release_port()
        wanted, self._wanted_port = self._wanted_port, 0  # --master-port: the first round's, if it is free
        listen = not self.config.roles and self.group.uses_round_store
        try:
            self._held_port = hold_port(port=wanted, listen=listen)
        except OSError:
            self._held_port = hold_port(listen=listen)
        return int(self._held_port.getsockname()[1])

    def _release_port(self, spare: bool = False) -> None:
        if self._held_port is not None:
            self._held_port.close()
            self._held_port = None
        if spare and self._spare_port is not None:
            self._spare_port.close()
            self._spare_port = None

    def _first_joined(self, job_id: str) -> None:
        """Before this node runs anything of the job: end what an earlier agent of the node left
        running (its workers' children, if it was SIGKILLed), then keep the workers in a cgroup."""
        left = reap(job_id, self.config.node_id, frozenset([self._forks.pid] if self._forks is not None else []))
        if left:
            log.warning(f"convoy agent {self.config.node_id}: stopped {left} process(es) an earlier agent of this node "
                        "left running")
        cgroup = NodeCgroup.create(job_id, self.config.node_id)
        if cgroup is not None:
            self.group.use_cgroup(cgroup)
        if self.config.roles:
            self._start_fork_server(job_id)

    def _open_lease(self) -> None:
        """Create this node's round lease once the job id is known (before any worker starts)."""
        if self.heartbeat.lease is not None or not self._job_id:
            return
        path = lease_path(self._job_id, self.config.node_id)
        try:
            self.heartbeat.lease = LeaseWriter(path)
        except OSError as exc:
            log.warning(f"convoy agent {self.config.node_id}: cannot create the round lease {path} ({exc.strerror}); "
                        "workers of an ended round are then fenced only by being stopped")
            return
        self.group.lease_file = str(path)

    def _revoke(self) -> None:
        self.heartbeat.running = None
        if self.heartbeat.lease is not None:
            self.heartbeat.lease.revoke()

    def _job_exit_code(self) -> int:
        return EXIT_OK if self._final_status == "succeeded" else EXIT_FAILED

    def _leave(self, reason: str) -> None:
        try:
            quick = MasterClient(self.config.master_host, self.config.master_port, self.config.token, 1.0,
                                 self.config.tls_ca)
            quick.call("/leave", p.LeaveRequest(node_id=self.config.node_id, reason=reason), p.Ack)
        except ConvoyError:
            pass  # the master may already be gone; leaving is a courtesy
