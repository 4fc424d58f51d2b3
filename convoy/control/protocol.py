"""The wire messages between agents and the master: the one contract of the control plane."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import BaseModel, Field

API_PREFIX = "/v1"
TOKEN_HEADER = "Authorization"
IDEMPOTENCY_HEADER = "Idempotency-Key"
"""Names one logical POST; its retries carry the same key, and the master answers them from its first reply."""

JobStatusName = Literal["running", "succeeded", "failed"]
# Bounded types for everything an agent sends: no request can carry a value the state cannot hold.
NodeId = Annotated[str, Field(min_length=1, max_length=200)]
RoundId = Annotated[int, Field(ge=0, le=2**31)]
Rank = Annotated[int, Field(ge=0, le=2**31)]
Text = Annotated[str, Field(max_length=4096)]


class JoinRequest(BaseModel):
    node_id: NodeId
    host: str = Field(min_length=1, max_length=255)
    nproc: int = Field(ge=1, le=4096)
    port: int = Field(gt=0, lt=65536, description="a free port on this host, MASTER_PORT if this node gets rank 0")
    instance: str = Field(default="", max_length=64, description="random id of this agent process")


class JoinResponse(BaseModel):
    job_id: str
    round_id: int


class MemberInfo(BaseModel):
    node_rank: int
    node_id: str
    host: str
    nproc: int
    rank_offset: int


class RoundInfo(BaseModel):
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
    roles: bool = Field(default=False, description="a job of roles: the node runs the role processes its "
                        "heartbeats assign, not a worker per local rank")


class WaitRequest(BaseModel):
    node_id: NodeId
    round_id: RoundId
    timeout_s: float = Field(ge=0, le=60)


class WaitResponse(BaseModel):
    state: Literal["waiting", "ready", "rejoin", "ended"]
    job_status: JobStatusName
    round: Optional[RoundInfo] = None


class HeartbeatRequest(BaseModel):
    node_id: NodeId
    round_id: RoundId
    wait_s: float = Field(default=0, ge=0, le=60, description="hold the answer until the round or job changes")
    addresses_version: int = Field(default=0, ge=0, le=2**62, description="the role addresses' version this node "
                                   "has: the answer comes at once when the master's is newer")


class RoleAssignment(BaseModel):
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


class RoleStop(BaseModel):
    """Stop one role process (SIGTERM, SIGKILL after the stop grace); only the named incarnation."""

    role: str
    rank: int
    incarnation: int
    reason: str = ""


class HeartbeatResponse(BaseModel):
    job_status: JobStatusName
    round_id: int
    message: str = ""
    assignments: list[RoleAssignment] = Field(default_factory=list)
    stops: list[RoleStop] = Field(default_factory=list)
    addresses: dict[str, list[str]] = Field(default_factory=dict, description="a job of roles: each role's "
                                            "current host:port by rank (\"\" for a process that is down)")
    addresses_version: int = Field(default=0, description="grows whenever ``addresses`` changes (0: no roles)")


class RoleReport(BaseModel):
    """A role process started (with its ``host:port``) or exited (with its code and last lines)."""

    node_id: NodeId
    role: str = Field(min_length=1, max_length=32)
    rank: Rank
    incarnation: Rank
    state: Literal["started", "exited"]
    address: str = Field(default="", max_length=300)
    exitcode: Optional[int] = Field(default=None, ge=-(2**31), le=2**31)
    signal: Optional[str] = Field(default=None, max_length=64)
    start_failed: bool = False
    log_path: Text = ""
    log_tail: list[Text] = Field(default_factory=list, max_length=200)

    def describe(self) -> str:
        if self.start_failed:
            return "could not be started"
        if self.signal:
            return f"was killed by {self.signal}"
        return f"exited with code {self.exitcode}"


class ScaleRequest(BaseModel):
    """Run ``count`` processes of ``role`` (``convoy scale --run-dir D worker=4``)."""

    role: str = Field(min_length=1, max_length=32)
    count: int = Field(ge=0, le=100000)


class WorkerExit(BaseModel):
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

    def describe(self) -> str:
        if self.start_failed:
            return "could not be started"
        if self.signal:
            return f"was killed by {self.signal}"
        return f"exited with code {self.exitcode}"


class WorkerEvent(BaseModel):
    """Something a worker recorded (``convoy.worker_events.emit``), forwarded by its agent."""

    node_id: NodeId
    round_id: RoundId
    rank: Rank
    kind: str = Field(pattern=r"^[a-z][a-z0-9_]{0,39}$")
    message: Text


class NodeDone(BaseModel):
    node_id: NodeId
    round_id: RoundId


class LeaveRequest(BaseModel):
    node_id: NodeId
    reason: Text = ""


class AbortRequest(BaseModel):
    reason: str = Field(min_length=1, max_length=2000)


class Ack(BaseModel):
    ok: bool = True


class ErrorBody(BaseModel):
    error: str
