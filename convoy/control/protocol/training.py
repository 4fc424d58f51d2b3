"""The wire messages of training status and the live training config: a worker process -> its agent's local API
-> the master, and the config a master pushes to the agents (which write it where the node's processes read it).

Kept apart from ``messages.py`` for the same reason as ``shards.py``: the worker side sends them too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from convoy.control.protocol.base import Message

Count = Annotated[int, Field(ge=0, le=2**62)]
Step = Annotated[int, Field(ge=0, le=2**62)]
Number = Annotated[float, Field(allow_inf_nan=True)]
ConfigValue = Union[bool, int, float, Annotated[str, Field(max_length=4096)]]
MAX_POINTS = 2000
"""Points in one report; a worker that has more (the agent was slow) sends the newest and counts the rest."""
MAX_METRICS = 32
MAX_METRIC_NAME = 64


class Task(Message):
    """Who reports: one process of the job (a plain worker is role ``default`` with its global RANK, and its
    round as incarnation)."""

    role: str = Field(min_length=1, max_length=200)
    rank: Count
    incarnation: Count

    @property
    def task_id(self) -> str:
        return f"{self.role}:{self.rank}"


class StatusPoint(Message):
    """A rank's status after one step (``convoy.report``)."""

    step: Step
    time: float = Field(description="wall-clock time the step ended (the worker's clock)")
    loss: Optional[Number] = None
    step_time_s: Optional[float] = Field(default=None, ge=0)
    samples_per_s: Optional[float] = Field(default=None, ge=0)
    memory_bytes: Optional[int] = Field(default=None, ge=0, le=2**62)
    grad_norm: Optional[Number] = None
    metrics: dict[Annotated[str, Field(max_length=MAX_METRIC_NAME)], Number] = Field(default_factory=dict,
                                                                                     max_length=MAX_METRICS)


class FieldDecl(Message):
    name: str = Field(min_length=1, max_length=100)
    type: Literal["int", "float", "bool", "str"]
    kind: Literal["hot", "restart"]
    default: ConfigValue
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    choices: list[ConfigValue] = Field(default_factory=list, max_length=256)
    doc: str = Field(default="", max_length=2000)


class ConfigDeclare(Task):
    """The script declares its training config (``convoy.train_config``); the first declaration makes version 1."""

    fields: list[FieldDecl] = Field(min_length=1, max_length=256)
    restartable: bool = True


class VersionInfo(Message):
    number: int
    values: dict[str, ConfigValue]
    changed: dict[str, ConfigValue] = Field(default_factory=dict)
    kind: str
    apply: Literal["hot", "restart"]
    at_step: int
    role_steps: dict[Annotated[str, Field(max_length=200)], int] = Field(
        default_factory=dict, description="a role's own first step with this version (others: at_step)")
    author: str = ""
    reason: str = ""
    created_at: float = 0.0
    status: str = ""

    def step_for(self, role: str) -> int:
        """The first step of ``role`` that runs with this version."""
        return self.role_steps.get(role, self.at_step)


class ConfigState(Message):
    """The config versions a rank needs: every version (newest last) with the step it takes effect at."""

    version: int = Field(description="the newest version's number (0: none declared yet)")
    versions: list[VersionInfo] = Field(default_factory=list)


class StatusReport(Task):
    """New status points, and what the rank did with the config since its last report."""

    sent_at: float = Field(description="wall-clock time of sending (the worker's clock)")
    points: list[StatusPoint] = Field(default_factory=list, max_length=MAX_POINTS)
    dropped: Count = Field(default=0, description="points the worker could not keep (it reports faster than sent)")
    switched: dict[Annotated[str, Field(max_length=12)], Step] = Field(
        default_factory=dict, description="version number -> the first step this rank ran with it")
    parked: Optional[Step] = Field(default=None, description="the rank finished this step and waits for the "
                                                                 "restart that applies a restart field")


class StatusAck(Message):
    version: int = Field(description="the config's newest version, so a rank that missed a push reads it again")


class ConfigSet(Message):
    """``PUT /v1/config``: the target config (only the fields to change)."""

    values: dict[Annotated[str, Field(max_length=100)], ConfigValue] = Field(min_length=1, max_length=256)
    author: str = Field(default="user", max_length=200)
    reason: str = Field(default="", max_length=2000)
    at_step: Optional[Step] = Field(default=None, description="the first step to run with it (at least the first "
                                                                  "step every rank can still reach); none: that one")


class ProposalAction(Message):
    """``POST /v1/config/proposals``: apply or dismiss a proposal."""

    proposal: int = Field(ge=1)
    action: Literal["apply", "dismiss"]
    author: str = Field(default="user", max_length=200)


def version_info(version: Any) -> VersionInfo:
    """A ``train_config.Version`` on the wire."""
    return VersionInfo(number=version.number, values=version.values, changed=version.changed, kind=version.kind,
                       apply=version.apply, at_step=version.at_step, role_steps=version.role_steps,
                       author=version.author, reason=version.reason,
                       created_at=version.created_at, status=version.status)
