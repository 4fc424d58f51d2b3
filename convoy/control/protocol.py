"""The wire messages between agents and the master: the one contract of the control plane."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field

API_PREFIX = "/v1"
TOKEN_HEADER = "Authorization"

JobStatusName = Literal["running", "succeeded", "failed"]


class JoinRequest(BaseModel):
    node_id: str = Field(min_length=1, max_length=200)
    host: str = Field(min_length=1, max_length=255)
    nproc: int = Field(ge=1)
    port: int = Field(gt=0, lt=65536, description="a free port on this host, MASTER_PORT if this node gets rank 0")


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


class WaitRequest(BaseModel):
    node_id: str
    round_id: int
    timeout_s: float = Field(ge=0, le=60)


class WaitResponse(BaseModel):
    state: Literal["waiting", "ready", "rejoin", "ended"]
    job_status: JobStatusName
    round: Optional[RoundInfo] = None


class HeartbeatRequest(BaseModel):
    node_id: str
    round_id: int
    wait_s: float = Field(default=0, ge=0, le=60, description="hold the answer until the round or job changes")


class HeartbeatResponse(BaseModel):
    job_status: JobStatusName
    round_id: int
    message: str = ""


class WorkerExit(BaseModel):
    node_id: str
    round_id: int
    rank: int
    local_rank: int
    exitcode: Optional[int] = None
    signal: Optional[str] = None
    start_failed: bool = False
    log_path: str = ""
    log_tail: list[str] = Field(default_factory=list)

    def describe(self) -> str:
        if self.start_failed:
            return "could not be started"
        if self.signal:
            return f"was killed by {self.signal}"
        return f"exited with code {self.exitcode}"


class NodeDone(BaseModel):
    node_id: str
    round_id: int


class LeaveRequest(BaseModel):
    node_id: str
    reason: str = ""


class Ack(BaseModel):
    ok: bool = True


class ErrorBody(BaseModel):
    error: str
