"""The Ray scheduler: the master beside the driver (``convoy run``), one agent per Ray node as an actor pinned to it.

The one place in convoy that imports Ray. Each agent's actor holds the node's share of the job (``NodeShare``) and
is pinned to its node (node affinity, not soft); the job starts once MIN nodes are placed and grows onto nodes that
join, up to MAX; a node that leaves ends its actor, its agent and its workers, and convoy's own heartbeats and the
agent's exit (not Ray's health checks) shrink the job, which goes on from the survivors' in-memory snapshots.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any

from convoy import log
from convoy.config import JobConfig
from convoy.errors import ConfigError
from convoy.launch.schedulers.local import LocalScheduler, agent_args, describe_exit
from convoy.launch.schedulers.ray_agent import NodeAgent
from convoy.launch.schedulers.ray_nodes import NodeShare, RayNode, from_listing, missing, to_place
from convoy.launch.schedulers.ray_priorities import Priorities

NAMESPACE = "convoy"
LIST_EVERY_S = 0.5
"""How often the cluster's nodes are listed (a node that joins gets an agent within about this, plus its start)."""
POLL_EVERY_S = 0.25
SKIP_FAILED_S = 5.0
"""How long a node whose placement failed is left alone before it is tried again."""
LOST = -1000
"""The exit code given to an agent whose actor died with its node."""
GIVEN = -1001
"""The exit code given to an agent stopped to give its node to a job of higher priority."""
CONNECT_TIMEOUT_S = 3.0
PEER_LOSS_WAIT_S = 6.0
"""The master's wait, on Ray, for news of a lost node before a peer's failure counts as a restart: a node's loss is
heard of when Ray reports its agent's actor dead (about 1.5 s here; more on a loaded or larger cluster), not at
once as a local agent's exit is."""
ACTOR_START_S = 30.0
"""How long an agent's actor may take to start on a node with room on paper (a Ray worker process to start; more
where the placement timeout is longer); past it, the node's room is taken by other work."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--scheduler ray needs Ray on this machine: pip install 'convoy[ray]' (and the same on every "
                          "node of the cluster)") from None
    return ray


def connect(address: str) -> Any:
    """Ray, connected to the cluster at ``address`` (``auto`` or the head's HOST:PORT); never a cluster of its
    own started here."""
    ray = import_ray()
    if address != "auto":
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--address {address!r}: give auto or the Ray head's HOST:PORT, e.g. 10.0.0.1:6379")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise ConfigError(f"no Ray cluster at {address} ({exc.strerror or exc}): start its head with `ray start "
                              "--head` or give the address `ray start` printed") from None
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every worker's line reaches the console, as with local nodes
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True, logging_level=logging.ERROR)
    except ConnectionError as exc:
        said = str(exc).splitlines()[0] if str(exc) else "nothing there"
        raise ConfigError(f"no Ray cluster found for --address {address}: start one with `ray start --head`, or give "
                          f"its head's HOST:PORT ({said})") from None
    return ray


def node_share(config: JobConfig) -> NodeShare:
    """What each agent of ``config`` holds on its Ray node."""
    min_nodes = config.master.rendezvous.min_nodes
    return NodeShare(cpus=config.ray.node_cpus(config.workers.nproc_per_node, config.roles, min_nodes),
                     gpus=config.ray.node_gpus(config.roles, min_nodes), memory_bytes=config.ray.memory_bytes,
                     resources=dict(config.ray.resources))


@dataclass
class Holder:
    """A node's actor, from the call that starts its agent to the agent's exit."""

    actor: Any
    node: RayNode
    pending: Any
    """The call in flight: the agent's start while placing, then the latest poll of its exit code."""
    since: float
    started: bool = False
    next_poll: float = 0.0


class RayScheduler:
    """The master as a child of this driver; agents as actors on the cluster's nodes."""

    def __init__(self, ray: Any, config: JobConfig, token: str, token_file: Any, port: int, master_host: str,
                 resume: bool = False) -> None:
        """``resume``: a driver started again (``convoy run --resume``): the master resumes from the run dir and the
        job's agents, whose actors outlived the driver that was killed, are taken back."""
        self.ray, self.config, self.token, self.port, self.master_host = ray, config, token, port, master_host
        self.resume = resume
        self.master = LocalScheduler(config, token_file, port, master_host=master_host, agent_host=None,
                                     master_dies_by=signal.SIGKILL)  # a killed driver leaves a job to --resume
        self.share = node_share(config)
        config.master.peer_loss_wait_s = max(config.master.peer_loss_wait_s, PEER_LOSS_WAIT_S)
        self.holders: dict[str, Holder] = {}
        self.exited: list[tuple[str, int]] = []
        self.skip: dict[str, float] = {}
        self.lost: set[str] = set()
        """Nodes whose agent's actor died with them: never placed on again (Ray may list one alive for a while)."""
        self.started_at = 0.0
        self.next_list = 0.0
        self.reached_min = False
        self.ever: list[str] = []
        self.priorities: Priorities | None = None
        self.given: set[str] = set()
        """Nodes whose agents are stopping to give the node to a job of higher priority."""

    def where(self) -> str:
        rendezvous = self.config.master.rendezvous
        count = rendezvous.min_nodes if rendezvous.min_nodes == rendezvous.max_nodes else \
            f"{rendezvous.min_nodes}:{rendezvous.max_nodes}"
        return f"{count} Ray node(s) holding {', '.join(f'{k} {v:g}' for k, v in self.share.request().items())} each"

    def nodes(self) -> list[RayNode]:
        return from_listing(self.ray.nodes())

    def start(self) -> None:
        """Wait (at most --placement-timeout) until MIN nodes could hold the job's share; then the master, and an
        agent on every node that can, up to MAX."""
        rendezvous, timeout = self.config.master.rendezvous, self.config.ray.placement_timeout_s
        self.started_at = time.monotonic()
        self.priorities = Priorities(self.ray, NAMESPACE, self.config.master.job_id, self.config.master.priority,
                                     rendezvous.min_nodes, self.share)
        if self.resume:
            self.master.start_master(resume=True)
            self._adopt()
            self.tick()
            return
        while True:
            nodes = self.nodes()
            if len(to_place(nodes, self.share, (), rendezvous.max_nodes)) >= rendezvous.min_nodes:
                break
            if time.monotonic() - self.started_at >= timeout:
                raise ConfigError(f"{missing(nodes, self.share, rendezvous.min_nodes)} (waited {timeout:g} s: add "
                                  "nodes, lower --nnodes MIN or the --ray-* amounts, or wait longer with "
                                  "--placement-timeout)")
            time.sleep(LIST_EVERY_S)
        self.started_at = time.monotonic()
        self.master.start_master(resume=False)
        self.tick()

    def _prefix(self) -> str:
        return f"convoy-{self.config.master.job_id}-"

    def _adopt(self) -> None:
        """The actors of this job's agents still alive after its driver was killed: polled as if placed here."""
        nodes = {node.name: node for node in self.nodes()}
        for actor_name in sorted(self.ray.util.list_named_actors()):
            name = actor_name[len(self._prefix()):].rpartition("-")[0]
            if not actor_name.startswith(self._prefix()) or name not in nodes:
                continue
            try:
                actor = self.ray.get_actor(actor_name)
            except ValueError:
                continue  # it ended since it was listed
            self.holders[name] = Holder(actor, nodes[name], None, time.monotonic(), started=True)
            self.ever.append(name)
            log.info(f"convoy: took back the agent of node {name} (Ray node {nodes[name].node_id})")
        self.reached_min = True  # the master's rendezvous decides from here

    def tick(self) -> None:
        now = time.monotonic()
        if now >= self.next_list:
            self.next_list = now + LIST_EVERY_S
            self.skip = {name: until for name, until in self.skip.items() if until > now}
            self._place_and_claim(now)
        self._collect(now)
        self._check_min(now)

    def _place_and_claim(self, now: float) -> None:
        """An agent on each node with room (besides other jobs' agents), up to MAX; this job's claim renewed; its
        nodes given back where a job of higher priority wants them."""
        priorities, max_nodes = self.priorities, self.config.master.rendezvous.max_nodes
        assert priorities is not None, "start() first"
        nodes = self.nodes()
        priorities.read()
        for node in to_place([node for node in nodes if priorities.free(node)], self.share, self.holders, max_nodes,
                             [*self.skip, *self.lost]):
            self._place(node)
        held = [holder.node.node_id for name, holder in self.holders.items() if name not in self.given]
        priorities.publish(held, max(0, max_nodes - len(self.holders)), nodes)
        giving = priorities.to_give(held, now)
        newest = sorted((holder.since, name) for name, holder in self.holders.items()
                        if holder.started and name not in self.given)
        for _, name in reversed(newest[-giving:] if giving else []):
            log.info(f"convoy: giving node {name} back to a job of higher priority on the Ray cluster")
            self.given.add(name)
            self.skip[name] = now + SKIP_FAILED_S
            self.holders[name].actor.stop.remote(self.config.workers.stop_grace_s)

    def _place(self, node: RayNode) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        share = self.share
        actor = self.ray.remote(NodeAgent).options(
            num_cpus=share.cpus, num_gpus=share.gpus, memory=share.memory_bytes or None,
            resources=dict(share.resources) or None, max_restarts=0, max_task_retries=0,
            name=f"{self._prefix()}{node.name}-{time.time_ns()}", lifetime="detached",  # it outlives a killed driver
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote(node.name)
        args = agent_args(self.config, f"{self.master_host}:{self.port}", node.name, node.address,
                          cpus=math.ceil(share.cpus))
        pending = actor.start.remote(args, self.token, os.getcwd())
        self.holders[node.name] = Holder(actor, node, pending, time.monotonic())
        if node.name not in self.ever:
            self.ever.append(node.name)
        log.debug(f"convoy: placing an agent on Ray node {node.node_id} ({node.address})")

    def _collect(self, now: float) -> None:
        """Answers of the calls in flight: agents started, placements that failed, agents that exited."""
        pending = [holder.pending for holder in self.holders.values() if holder.pending is not None]
        ready = set(self.ray.wait(pending, num_returns=len(pending), timeout=0)[0]) if pending else set()
        for name, holder in list(self.holders.items()):
            if holder.pending is not None and holder.pending in ready:
                self._answered(name, holder, now)
            elif not holder.started and now - holder.since > self._start_bound():
                self._drop(name, f"not placed in {self._start_bound():g} s (its resources are taken)")
            elif holder.started and holder.pending is None and now >= holder.next_poll:
                holder.pending = holder.actor.exit_code.remote()

    def _answered(self, name: str, holder: Holder, now: float) -> None:
        try:
            answer = self.ray.get(holder.pending)
        except self.ray.exceptions.RayError as exc:
            if holder.started:
                del self.holders[name]
                self.lost.add(name)
                self.exited.append((name, LOST))
            else:
                self._drop(name, f"its actor failed ({type(exc).__name__}; the node may have left)")
            return
        holder.pending, holder.next_poll = None, now + POLL_EVERY_S
        if not holder.started:
            holder.started = True
            log.debug(f"convoy: agent of node {name} started on Ray node {holder.node.node_id} (pid {answer})")
        elif answer is not None:
            del self.holders[name]
            self.exited.append((name, GIVEN if name in self.given else int(answer)))
            self.given.discard(name)
            self.ray.kill(holder.actor, no_restart=True)  # its share goes back to the cluster

    def _drop(self, name: str, why: str) -> None:
        holder = self.holders.pop(name)
        self.skip[name] = time.monotonic() + SKIP_FAILED_S
        self.ray.kill(holder.actor, no_restart=True)
        log.warning(f"convoy: could not place an agent on Ray node {holder.node.node_id}: {why}")

    def _check_min(self, now: float) -> None:
        """Before MIN agents first run: fail once the placement timeout has passed (the nodes had room on paper,
        but others hold it)."""
        min_nodes = self.config.master.rendezvous.min_nodes
        if self.reached_min:
            return
        if sum(holder.started for holder in self.holders.values()) >= min_nodes:
            self.reached_min = True
        elif now - self.started_at > self._start_bound() + LIST_EVERY_S:
            raise ConfigError(f"only {sum(h.started for h in self.holders.values())} of the {min_nodes} node(s) MIN "
                              f"asks for were placed on the Ray cluster in {self._start_bound():g} s "
                              f"(each holding {', '.join(f'{k} {v:g}' for k, v in self.share.request().items())}); "
                              "the rest are held by other work: free them, lower --nnodes MIN, or wait longer with "
                              "--placement-timeout")

    def _start_bound(self) -> float:
        return max(ACTOR_START_S, self.config.ray.placement_timeout_s)

    def start_master(self, resume: bool) -> None:
        self.master.start_master(resume)

    def master_exit(self) -> int | None:
        return self.master.master_exit()

    def newly_exited(self) -> list[tuple[str, int]]:
        exited, self.exited = self.exited, []
        return exited

    def describe(self, code: int) -> str:
        if code == GIVEN:
            return "stopped: its node given to a job of higher priority"
        return "lost with its Ray node (its actor died)" if code == LOST else describe_exit(code)

    def relaunch(self, node_id: str) -> str:
        return "a new agent goes on any Ray node with room for it"

    def running(self) -> list[str]:
        return [name for name, holder in self.holders.items() if holder.started]

    def node_ids(self) -> list[str]:
        return list(self.ever)

    def wait(self, timeout: float) -> bool:
        """Wait for the master and every agent to exit (each agent ends on its own with the job)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._collect(time.monotonic())
            if not any(holder.started for holder in self.holders.values()) and self.master.master_exit() is not None:
                break
            time.sleep(0.05)
        return self.master.wait(max(0.0, deadline - time.monotonic())) and not self.running()

    def stop(self, grace_s: float) -> None:
        """Each agent stopped (SIGTERM, SIGKILL after ``grace_s``), its actor ended; the master stopped."""
        stops = {name: holder.actor.stop.remote(grace_s) for name, holder in self.holders.items() if holder.started}
        if stops:
            self.ray.wait(list(stops.values()), num_returns=len(stops), timeout=grace_s + 5.0)
        for holder in self.holders.values():
            self.ray.kill(holder.actor, no_restart=True)
        self.holders.clear()
        if self.priorities is not None:
            self.priorities.close()
            self.priorities = None
        self.master.stop(grace_s)
