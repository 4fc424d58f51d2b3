"""The wire messages between agents and the master: the one contract of the control plane."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import Field

from convoy.control.protocol.base import Message
from convoy.control.protocol.training import ConfigState
from convoy.sanitize import SAFE_HOST, SAFE_NAME

API_PREFIX = "/v1"
TOKEN_HEADER = "Authorization"
IDEMPOTENCY_HEADER = "Idempotency-Key"
"""Names one logical POST; its retries carry the same key, and the master answers them from its first reply."""

JobStatusName = Literal["running", "succeeded", "failed"]
# Bounded types for everything an agent sends: no request can carry a value the state cannot hold.
NodeId = Annotated[str, Field(min_length=1, max_length=200, pattern=SAFE_NAME)]
RoundId = Annotated[int, Field(ge=0, le=2**31)]
Rank = Annotated[int, Field(ge=0, le=2**31)]
Text = Annotated[str, Field(max_length=4096)]


class JoinRequest(Message):
    node_id: NodeId
    host: str = Field(min_length=1, max_length=255, pattern=SAFE_HOST)
    nproc: int = Field(ge=1, le=4096)
    port: int = Field(gt=0, lt=65536, description="a free port on this host, MASTER_PORT if this node gets rank 0")
    instance: str = Field(default="", max_length=64, description="random id of this agent process")
    memory_available_bytes: int = Field(default=0, ge=0, description="memory this node can still give processes "
                                        "(MemAvailable, within the agent's cgroup limit); 0: unknown")
    memory_limit_bytes: int = Field(default=0, ge=0, description="the agent's cgroup memory limit (0: none)")
    cpus: int = Field(default=0, ge=0, le=100000, description="CPUs this agent may use (0: unknown)")
    gpus: int = Field(default=0, ge=0, le=4096, description="GPUs this agent may hand out to role processes")
    node_rank: int = Field(default=-1, ge=-1, le=100000, description="the node rank asked for (torchrun's "
                           "--node-rank): a first round orders its nodes by it; -1: none")


class JoinResponse(Message):
    job_id: str
    round_id: int


class MemberInfo(Message):
    node_rank: int
    node_id: str
    host: str
    nproc: int
    rank_offset: int


class RoundInfo(Message):
    job_id: str
    round_id: int
    members: list[MemberInfo]
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    lease_s: float = Field(default=0.0, description="the master's heartbeat timeout: how long a node's round "
                           "lease lasts after a heartbeat (0: no lease)")
    restore_at_most: Optional[int] = Field(default=None, description="a round that rolls the job back: its workers "
                                           "restore no checkpoint newer than this step (CONVOY_RESTORE_AT_MOST)")
    roles: bool = Field(default=False, description="a job of roles: the node runs the role processes its "
                        "heartbeats assign, not a worker per local rank")


class WaitRequest(Message):
    node_id: NodeId
    round_id: RoundId
    timeout_s: float = Field(ge=0, le=60)
    next_port: int = Field(default=0, ge=0, lt=65536, description="a port this node holds for the round after "
                           "this one: if the same nodes regroup, it is placed in that round at once, without a join; "
                           "0: none")


class WaitResponse(Message):
    state: Literal["waiting", "ready", "rejoin", "ended"]
    job_status: JobStatusName
    round: Optional[RoundInfo] = None


class HeartbeatRequest(Message):
    node_id: NodeId
    round_id: RoundId
    wait_s: float = Field(default=0, ge=0, le=60, description="hold the answer until the round or job changes")
    addresses_version: int = Field(default=0, ge=0, le=2**62, description="the role addresses' version this node "
                                   "has: the answer comes at once when the master's is newer")
    config_version: int = Field(default=0, ge=0, le=2**62, description="the training config's version this node "
                                "has: the answer comes at once (with the versions) when the master's is newer")


class RoleAssignment(Message):
    """Start one role process on this node; an agent ignores an incarnation it has started already."""

    role: str
    rank: int
    incarnation: int
    restore: bool = Field(default=False, description="the process takes back the state its rank had")
    port: int = Field(default=0, ge=0, lt=65536, description="CONVOY_ROLE_PORT; 0: the agent picks a free one")
    world_size: int
    addresses: dict[str, list[str]] = Field(default_factory=dict)
    entrypoint: str = Field(default="", description="the role's script or module; empty: the job's script")
    module: bool = False
    args: list[str] = Field(default_factory=list)
    reason: str = ""
    memory_limit_bytes: int = Field(default=0, ge=0, description="enforce this memory limit on the process "
                                    "tree (a cgroup, else an RSS watchdog); 0: none")
    measure: bool = Field(default=False, description="sample this process from its start: it measures the "
                          "iteration its role is sized from")
    gpus: list[int] = Field(default_factory=list, max_length=4096, description="the node's devices (indices into "
                            "what the agent sees) handed to the process: its CUDA_VISIBLE_DEVICES")
    gpus_managed: bool = Field(default=False, description="some role of the job declares gpus: the process sees "
                               "exactly its ``gpus`` (none: an empty CUDA_VISIBLE_DEVICES), not the node's")
    cpus: float = Field(default=0.0, ge=0, le=100000, description="the CPUs the process may use (its role's "
                        "cpus), enforced by its agent; 0: no limit")
    threads: int = Field(default=0, ge=0, le=4096, description="OMP_NUM_THREADS of the process (its role's cpus); "
                         "0: one, unless the job's environment sets it")
    group_round: int = Field(default=0, ge=0, description="the round of the role's process group (RANK, WORLD_SIZE "
                             "and MASTER_* of the role); 0: the role forms no group")
    group_address: str = Field(default="", max_length=300, description="host:port where the group's rank 0 serves "
                               "its rendezvous; empty for rank 0 itself (it serves on its role port)")


class RoleStop(Message):
    """Stop one role process (SIGTERM, SIGKILL after the stop grace); only the named incarnation."""

    role: str
    rank: int
    incarnation: int
    reason: str = ""
    notice_s: float = Field(default=0.0, ge=0, le=3600, description="preempted: the process is told at once "
                            "(convoy.role().preempted) and gets SIGTERM only this many seconds later; 0: SIGTERM now")


class AddressChanges(Message):
    """The role addresses from the node's version ``since`` to the reply's ``addresses_version``: every role's number
    of ranks, and only the entries that changed, by rank index (a large job sends these, not every address)."""

    since: int = Field(ge=1)
    sizes: dict[str, int] = Field(default_factory=dict)
    addresses: dict[str, dict[int, str]] = Field(default_factory=dict)
    incarnations: dict[str, dict[int, int]] = Field(default_factory=dict)

    def applied_to(self, addresses: dict[str, list[str]], incarnations: dict[str, list[int]]
                   ) -> tuple[dict[str, list[str]], dict[str, list[int]]]:
        """The addresses and incarnations a node holds at ``since``, brought to the reply's version (new lists)."""
        def brought(held: dict[str, list[Any]], changed: dict[str, dict[int, Any]], blank: Any) -> dict[str, list[Any]]:
            result = {}
            for role, size in self.sizes.items():
                entries = (list(held.get(role, ())) + [blank] * size)[:size]
                for index, entry in changed.get(role, {}).items():
                    if 0 <= index < size:
                        entries[index] = entry
                result[role] = entries
            return result

        return brought(addresses, self.addresses, ""), brought(incarnations, self.incarnations, 0)


class HeartbeatResponse(Message):
    job_status: JobStatusName
    round_id: int
    message: str = ""
    assignments: list[RoleAssignment] = Field(default_factory=list)
    stops: list[RoleStop] = Field(default_factory=list)
    addresses: dict[str, list[str]] = Field(default_factory=dict, description="a job of roles: each role's "
                                            "current host:port by rank (\"\" for a process that is down)")
    addresses_version: int = Field(default=0, description="grows whenever ``addresses`` changes (0: no roles)")
    incarnations: dict[str, list[int]] = Field(default_factory=dict, description="a job of roles: each role's "
                                               "current incarnation by rank, beside ``addresses`` (a role service "
                                               "refuses a caller of an incarnation that has ended)")
    address_changes: Optional[AddressChanges] = Field(default=None, description="set in place of ``addresses`` "
                                                      "and ``incarnations``: what changed since the node's version")
    train_config: Optional[ConfigState] = Field(default=None, description="the training config's versions, when "
                                                "newer than the node's ``config_version``")
    poll_s: float = Field(default=0.0, ge=0, le=60, description="the poll the master asks of the node's next "
                          "heartbeat (longer with more nodes, to bound its load; 0: the node's own)")


class RoleReport(Message):
    """A role process started (with its ``host:port``) or exited (with its code and last lines)."""

    node_id: NodeId
    role: str = Field(min_length=1, max_length=32)
    rank: Rank
    incarnation: Rank
    state: Literal["started", "exited"]
    address: str = Field(default="", max_length=300)
    pid: int = Field(default=0, ge=0, le=2**31, description="the started process's pid on its node (0: not known)")
    cpu_limit: str = Field(default="", max_length=200, description="how its role's cpus hold it, e.g. \"1.5 CPU(s) "
                           "by cgroup-v1\" (empty: no cpus declared)")
    exitcode: Optional[int] = Field(default=None, ge=-(2**31), le=2**31)
    signal: Optional[str] = Field(default=None, max_length=64)
    start_failed: bool = False
    log_path: Text = ""
    log_tail: list[Text] = Field(default_factory=list, max_length=200)
    oom_killed: bool = Field(default=False, description="its memory limit killed it (LimitOutcome.oom_killed)")
    memory_peak_bytes: int = Field(default=0, ge=0, description="the highest memory its limit measured")
    overshoot_bytes: int = Field(default=0, ge=0, description="how far past its limit it was seen")
    infrastructure: str = Field(default="", max_length=300, description="not empty: the process died of a fault "
                                "of the node's infrastructure, not of its own, named as a sentence (\"the fork "
                                "server of node n0 died (SIGKILL)\", \"node n0 was lost\"); it costs its role no "
                                "restart")

    def describe(self) -> str:
        if self.infrastructure:
            return f"was ended by an infrastructure fault ({self.infrastructure})"
        if self.start_failed:
            return "could not be started"
        if self.oom_killed:
            return f"was OOM-killed at its memory limit ({self.signal or f'code {self.exitcode}'})"
        if self.signal:
            return f"was killed by {self.signal}"
        return f"exited with code {self.exitcode}"

    def last_lines(self) -> str:
        """The log's last lines, indented under one line naming the log (empty when there are none)."""
        if not self.log_tail:
            return ""
        lines = "\n".join(f"    {line}" for line in self.log_tail[-10:])
        return f"\n  last lines of {self.log_path or 'its log'}:\n{lines}"


class MeasuredIterationReport(Message):
    """The measuring iteration of a role's rank 0: its shape and its process tree's memory (the agent's
    samples); the master predicts the role's memory from it."""

    batch_size: int = Field(ge=1, le=2**40)
    sample_bytes: int = Field(ge=1, le=2**50)
    state_bytes: int = Field(ge=0, le=2**60)
    activation_bytes: Optional[int] = Field(default=None, ge=0, le=2**60)
    peak_rss_bytes: int = Field(ge=0, le=2**60)
    peak_uss_bytes: int = Field(ge=0, le=2**60)
    baseline_rss_bytes: int = Field(ge=0, le=2**60)
    baseline_uss_bytes: int = Field(ge=0, le=2**60)
    duration_s: float = Field(ge=0)
    num_samples: int = Field(ge=0)
    gpu_peak_bytes: Optional[int] = Field(default=None, ge=0, le=2**60)
    """On a GPU: what the caching allocator reserved at most during the iteration (None: no GPU in use)."""


class ProcessMemory(Message):
    """One role process's memory so far: its sampled peak, and the limit it runs under."""

    role: str = Field(min_length=1, max_length=32)
    rank: Rank
    incarnation: Rank
    peak_rss_bytes: int = Field(ge=0, le=2**60)
    limit_bytes: int = Field(default=0, ge=0, le=2**60)
    mechanism: str = Field(default="", max_length=32)
    measured: Optional[MeasuredIterationReport] = None
    measuring: bool = Field(default=False, description="it has begun its measuring iteration, not ended it")


class MemoryReport(Message):
    """A node's memory and its role processes' peaks (sent when there is news, and every heartbeat period)."""

    node_id: NodeId
    memory_available_bytes: int = Field(default=0, ge=0)
    memory_limit_bytes: int = Field(default=0, ge=0)
    processes: list[ProcessMemory] = Field(default_factory=list, max_length=4096)


class ScaleRequest(Message):
    """Run ``count`` processes of ``role`` (``convoy scale --run-dir D worker=4``)."""

    role: str = Field(min_length=1, max_length=32)
    count: int = Field(ge=0, le=100000)
    author: str = Field(default="", max_length=200)
    """Who asked (the dashboard names its session); recorded in the job's events when given."""


class WorkerExit(Message):
    node_id: NodeId
    round_id: RoundId
    rank: Rank
    local_rank: Rank
    exitcode: Optional[int] = Field(default=None, ge=-(2**31), le=2**31)
    signal: Optional[str] = Field(default=None, max_length=64)
    start_failed: bool = False
    log_path: Text = ""
    log_tail: list[Text] = Field(default_factory=list, max_length=200)
    port_in_use: bool = Field(default=False, description="the worker could not bind MASTER_PORT (EADDRINUSE): "
                              "the round is retried with a new port, not counted as a restart")
    peer_lost: bool = Field(default=False, description="its last lines say a peer was gone (a closed or reset "
                            "connection): the failure may follow another node's loss, which the master waits a "
                            "moment to hear of before it spends a restart")
    infrastructure: str = Field(default="", max_length=300, description="not empty: the worker died of a fault of "
                                "the node's infrastructure, named here (its fork server died); the job regroups "
                                "within the node's --max-regroups budget instead of spending a restart")

    def describe(self) -> str:
        if self.start_failed:
            return "could not be started"
        how = f"was killed by {self.signal}" if self.signal else f"exited with code {self.exitcode}"
        return f"{how} in an infrastructure fault ({self.infrastructure})" if self.infrastructure else how


class WorkerEvent(Message):
    """Something a worker recorded (``convoy.worker.events.emit``), forwarded by its agent."""

    node_id: NodeId
    round_id: RoundId
    rank: Rank
    kind: str = Field(pattern=r"^[a-z][a-z0-9_]{0,39}$")
    message: Text


class NodeDone(Message):
    node_id: NodeId
    round_id: RoundId


class LeaveRequest(Message):
    node_id: NodeId
    reason: Text = ""


class AbortRequest(Message):
    reason: str = Field(min_length=1, max_length=2000)


class Ack(Message):
    ok: bool = True


class ErrorBody(Message):
    error: str
