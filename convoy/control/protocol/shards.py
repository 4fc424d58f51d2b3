"""The wire messages of dynamic data shards: a worker process -> its agent's local API -> the master.

Kept apart from ``messages.py`` (the agent<->master contract of rounds and roles) because the worker side sends
them too; both hops carry the same models, so the agent forwards a validated request as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional

from pydantic import Field

from convoy.control.protocol.base import Message
from convoy.errors import ConfigError

DatasetName = Annotated[str, Field(min_length=1, max_length=200)]
Count = Annotated[int, Field(ge=0, le=2**62)]
RANGE, FILES, SEEDS = "range", "files", "seeds"


@dataclass(frozen=True)
class Dataset:
    """What is cut: ``size`` samples (``range``), one item per file (``files``), or ``size`` generator seeds
    starting at ``first_seed`` (``seeds``)."""

    kind: str
    size: int
    files: tuple[str, ...] = ()
    first_seed: int = 0

    @classmethod
    def index_range(cls, num_samples: int) -> Dataset:
        return cls(RANGE, num_samples)

    @classmethod
    def file_list(cls, files: list[str] | tuple[str, ...]) -> Dataset:
        return cls(FILES, len(files), tuple(files))

    @classmethod
    def seed_space(cls, num_seeds: int, first_seed: int = 0) -> Dataset:
        return cls(SEEDS, num_seeds, (), first_seed)

    def validate(self) -> None:
        if self.kind not in (RANGE, FILES, SEEDS):
            raise ConfigError(f"dataset kind {self.kind!r} is unknown; use {RANGE!r}, {FILES!r} or {SEEDS!r}")
        if self.size <= 0:
            raise ConfigError(f"the dataset ({self.kind}) is empty (size {self.size}); give it at least one item")
        if self.kind == FILES and len(self.files) != self.size:
            raise ConfigError(f"a file dataset of size {self.size} lists {len(self.files)} files")


class ShardWorker(Message):
    """Who asks: one process (``role:rank:incarnation``); a new incarnation of a rank is another worker, so a
    late report of the old one cannot count for the new one's shard."""

    name: DatasetName = Field(description="the dataset's name, as the script declared it")
    role: str = Field(min_length=1, max_length=200)
    rank: Count
    incarnation: Count = Field(description="CONVOY_ROLE_INCARNATION of a role process, CONVOY_ROUND of a worker")

    @property
    def worker_id(self) -> str:
        return f"{self.role}:{self.rank}:{self.incarnation}"


class DatasetSpec(Message):
    kind: Literal["range", "files", "seeds"]
    size: Annotated[int, Field(ge=1, le=2**62)]
    files: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list)
    first_seed: int = 0

    def dataset(self) -> Dataset:
        return Dataset(self.kind, self.size, tuple(self.files), self.first_seed)

    @classmethod
    def of(cls, dataset: Dataset) -> DatasetSpec:
        return cls(kind=dataset.kind, size=dataset.size, files=list(dataset.files),  # type: ignore[arg-type]
                   first_seed=dataset.first_seed)


class ShardDeclare(ShardWorker):
    """Cut dataset ``name`` (the first declaration wins; an equal one is a no-op, a different one a 409)."""

    dataset: DatasetSpec
    num_shards: Annotated[int, Field(ge=1, le=2**31)]
    num_epochs: Annotated[int, Field(ge=1, le=2**31)] = 1
    shuffle_seed: Optional[int] = None


class ShardDeclared(Message):
    name: str
    declared_by: str = Field(description="the worker whose declaration made the queue")
    first: bool = Field(description="this request's declaration made it")


class ShardRequest(ShardWorker):
    """Ask for work; a repeat while the worker holds a shard returns that same grant."""


class ShardDone(ShardWorker):
    """The worker trained every item of its grant."""

    grant_id: Annotated[int, Field(ge=0, le=2**62)]


class ShardProgress(ShardDone):
    """The worker trained its grant's items below dataset index ``trained_through``."""

    trained_through: Count


class ShardGrant(Message):
    """``assigned``: train items [start, stop) of the dataset; ``wait``: ask again soon (others hold the rest of
    the epoch and may give some back); ``finished``: every epoch is done."""

    status: Literal["assigned", "wait", "finished"]
    epoch: int
    grant_id: int = -1
    shard_id: int = -1
    start: int = 0
    stop: int = 0


class ShardAck(Message):
    ok: bool = True
