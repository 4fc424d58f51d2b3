"""``convoy.shards()``: a worker's side of dynamic data shards, torch-free.

The script declares its dataset once (every process may; the first declaration wins) and iterates the shards
the master hands it; it reports progress as it trains (``shard.batches(n)`` does after each batch) so that a
fault gives back only what was not reported. Under convoy the calls go to the node's agent
(``CONVOY_AGENT_URL``); outside it (plain ``python``) an in-process queue hands this one process the whole
dataset, so the script runs unchanged.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from convoy.control.protocol import shards as sp
from convoy.control.protocol.shards import Dataset
from convoy.control.shards.master import ShardMaster  # outside convoy, the master's own queue runs in-process
from convoy.control.shards.queue import Shard as QueueShard
from convoy.errors import ConfigError, ConvoyError, MasterUnreachableError
from convoy.local_http import Connection
from convoy.worker.role_env import DEFAULT_ROLE, role

AGENT_URL_ENV, AGENT_TOKEN_ENV = "CONVOY_AGENT_URL", "CONVOY_AGENT_TOKEN"
"""Set by the agent (``convoy.agent.local_api``); read here."""
CALL_TIMEOUT_S = 90.0
"""Longer than the agent keeps retrying an unreachable master."""
UNREACHABLE_S = 60.0
"""How long the agent may be unreachable (or the master unanswering) before a call fails."""
WAIT_FIRST_S, WAIT_MOST_S = 0.05, 1.0
Reply = TypeVar("Reply", bound=BaseModel)


class Backend(Protocol):
    def call(self, path: str, request: BaseModel, reply: type[Reply]) -> Reply | str:
        """The reply, or why the control plane refused the call (a conflict with the job's state)."""


class LocalBackend:
    """Outside convoy: the master's own shard logic, in this process."""

    def __init__(self) -> None:
        self.master = ShardMaster()

    def call(self, path: str, request: BaseModel, reply: type[Reply]) -> Reply | str:
        answer = self.master.call(request)  # type: ignore[arg-type]
        return answer.refusal if answer.reply is None else reply.model_validate(answer.reply.model_dump())


class AgentBackend:
    """Under convoy: HTTP to the node's agent, which forwards to the master."""

    def __init__(self, url: str, token: str, unreachable_s: float = UNREACHABLE_S,
                 call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ConfigError(f"{AGENT_URL_ENV}={url!r} is not http://HOST:PORT; start the script with convoy")
        self.host, self.port, self.token = parsed.hostname, parsed.port, token
        self.unreachable_s, self.call_timeout_s = unreachable_s, call_timeout_s
        self._conn = Connection(self.host, self.port, call_timeout_s)

    def call(self, path: str, request: BaseModel, reply: type[Reply]) -> Reply | str:
        body = request.model_dump_json().encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"}
        deadline, backoff = time.monotonic() + self.unreachable_s, WAIT_FIRST_S
        while True:
            try:
                status, data = self._conn.post(f"/v1{path}", body, headers)
            except OSError as exc:  # the connection is closed; the next try opens another
                status, data = 0, str(exc).encode()
            if status == 200:
                return reply.model_validate_json(data)
            if status == 409:
                return _error_text(data)
            if status not in (0, 502) or time.monotonic() + backoff > deadline:
                raise (MasterUnreachableError if status in (0, 502) else ConvoyError)(
                    f"the agent's local API at {self.host}:{self.port} answered {path} with {status or 'nothing'}: "
                    f"{_error_text(data)}")
            time.sleep(backoff)
            backoff = min(backoff * 2, WAIT_MOST_S)


@dataclass
class Shard:
    """One grant: train ``items``, report ``progress`` as they are trained; ``lost`` once the master took the
    shard back (this process is no longer its holder: stop training it)."""

    stream: ShardStream
    epoch: int
    shard_id: int
    grant_id: int
    start: int
    stop: int
    items: list[Any] = field(default_factory=list)
    trained: int = 0
    """Items reported trained so far."""
    finished: bool = False
    lost: bool = False

    def __len__(self) -> int:
        return len(self.items)

    def progress(self, trained: int) -> bool:
        """The first ``trained`` items of this shard are trained; False when the shard is no longer this
        process's."""
        if not 0 <= trained <= len(self.items):
            raise ConfigError(f"progress of {trained} items on a shard of {len(self.items)}")
        if self.lost or self.finished or trained == self.trained:
            return not self.lost
        report = sp.ShardProgress(**self.stream.who(), grant_id=self.grant_id, trained_through=self.start + trained)
        return self._answered(self.stream.backend.call("/shards/progress", report, sp.ShardAck), trained)

    def done(self) -> bool:
        """Every item of this shard is trained (idempotent); False when the shard is no longer this process's."""
        if self.lost or self.finished:
            return not self.lost
        report = sp.ShardDone(**self.stream.who(), grant_id=self.grant_id)
        self.finished = self._answered(self.stream.backend.call("/shards/done", report, sp.ShardAck), len(self))
        return self.finished

    def batches(self, batch_size: int) -> Iterator[list[Any]]:
        """The items in batches; each batch is reported trained when the next is asked for (after the loop body
        ran for it), the shard done after the last. Stops early when the shard was taken back."""
        if batch_size < 1:
            raise ConfigError(f"batch_size is {batch_size}; give 1 or more items per batch")
        for begin in range(self.trained, len(self.items), batch_size):
            end = min(begin + batch_size, len(self.items))
            yield self.items[begin:end]
            if not self.progress(end):
                return
        self.done()

    def _answered(self, answer: sp.ShardAck | str, trained: int) -> bool:
        if isinstance(answer, str):
            self.lost = True
            print(f"convoy: shard {self.shard_id} of {self.stream.name!r} is no longer this worker's: {answer}",
                  file=sys.stderr, flush=True)
            return False
        self.trained = trained
        return True


class ShardStream:
    """Iterate to get shards until every epoch is done; a shard left without ``done()`` when the next is asked
    for counts as trained (the loop moved on)."""

    def __init__(self, name: str, dataset: Dataset, num_shards: int, epochs: int, shuffle_seed: int | None,
                 env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        info = role(env)
        incarnation = env.get("CONVOY_ROLE_INCARNATION", env.get("CONVOY_ROUND", "0"))
        if not incarnation.isdigit():
            raise ConfigError(f"CONVOY_ROLE_INCARNATION/CONVOY_ROUND {incarnation!r} is not a whole number")
        self.name, self.dataset = name, dataset
        plain = "CONVOY_ROLE_INCARNATION" not in env  # a plain worker is of the default role, whatever its ROLE_NAME
        self._who = {"name": name, "role": DEFAULT_ROLE if plain else info.name, "rank": info.rank,
                     "incarnation": int(incarnation)}
        url = env.get(AGENT_URL_ENV)
        self.backend: Backend = AgentBackend(url, env.get(AGENT_TOKEN_ENV, "")) if url else LocalBackend()
        declare = sp.ShardDeclare(**self._who, dataset=sp.DatasetSpec.of(dataset), num_shards=num_shards,
                                  num_epochs=epochs, shuffle_seed=shuffle_seed)
        declared = self.backend.call("/shards/declare", declare, sp.ShardDeclared)
        if isinstance(declared, str):
            raise ConfigError(declared)
        self.declared_by, self.first = declared.declared_by, declared.first

    def who(self) -> dict[str, Any]:
        return dict(self._who)

    def __iter__(self) -> Iterator[Shard]:
        backoff = WAIT_FIRST_S
        while True:
            grant = self.backend.call("/shards/request", sp.ShardRequest(**self._who), sp.ShardGrant)
            if isinstance(grant, str):
                raise ConvoyError(f"no shard of {self.name!r} for this process: {grant}")
            if grant.status == "finished":
                return
            if grant.status == "wait":  # others hold the rest of the epoch; one may give some back
                time.sleep(backoff)
                backoff = min(backoff * 2, WAIT_MOST_S)
                continue
            backoff = WAIT_FIRST_S
            items = QueueShard(grant.shard_id, grant.start, grant.stop).items(self.dataset)
            shard = Shard(self, grant.epoch, grant.shard_id, grant.grant_id, grant.start, grant.stop, items)
            yield shard
            shard.done()


def shards(name: str = "train", *, num_samples: int | None = None, files: Sequence[str] | None = None,
           num_seeds: int | None = None, first_seed: int = 0, shard_size: int | None = None,
           num_shards: int | None = None, epochs: int = 1, shuffle_seed: int | None = None,
           env: Mapping[str, str] | None = None) -> ShardStream:
    """Declare dataset ``name`` (one of ``num_samples`` indices, ``files``, or ``num_seeds`` seeds from
    ``first_seed``), cut into shards of ``shard_size`` items or into ``num_shards``, and iterate its shards."""
    given = [kind for kind, value in (("num_samples", num_samples), ("files", files), ("num_seeds", num_seeds))
             if value is not None]
    if len(given) != 1:
        raise ConfigError(f"give exactly one of num_samples, files or num_seeds (got {', '.join(given) or 'none'})")
    if num_samples is not None:
        dataset = Dataset.index_range(num_samples)
    elif files is not None:
        dataset = Dataset.file_list(tuple(str(f) for f in files))
    else:
        dataset = Dataset.seed_space(int(num_seeds or 0), first_seed)
    dataset.validate()
    if (shard_size is None) == (num_shards is None):
        raise ConfigError("give exactly one of shard_size (items per shard) or num_shards")
    if shard_size is not None:
        if shard_size < 1:
            raise ConfigError(f"shard_size is {shard_size}; give 1 or more items per shard")
        num_shards = math.ceil(dataset.size / shard_size)
    if not 1 <= int(num_shards or 0) <= dataset.size:
        raise ConfigError(f"num_shards is {num_shards}; cut the {dataset.size} items into 1 to {dataset.size} shards")
    if epochs < 1:
        raise ConfigError(f"epochs is {epochs}; train at least 1 epoch")
    return ShardStream(name, dataset, int(num_shards or 0), epochs, shuffle_seed, env)


def _error_text(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"])
    except (ValueError, KeyError, TypeError):
        return data.decode(errors="replace")
