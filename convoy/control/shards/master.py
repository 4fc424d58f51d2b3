"""The master's side of dynamic data shards: one ``ShardQueue`` per declared dataset, fed by the workers' calls
and by the exits of their processes. Pure (JobMaster holds its lock around each call, records the events and
persists ``state()`` with the job's state, so a restarted master goes on at the same position)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from convoy.control.job import Event
from convoy.control.protocol import shards as sp
from convoy.control.shards.queue import ASSIGNED, FILES, Dataset, ShardQueue
from convoy.errors import ConfigError

STATE_PART = "shards"
"""The name of this state in the job's state file (``Store.parts``)."""
PLAIN_ROLE = "default"
"""The role of a job's plain workers (no roles declared): their incarnation is the round they run in."""


@dataclass
class Answer:
    """What a call leads to: the reply (None when refused), the events to record, and why it was refused."""

    reply: BaseModel | None
    events: list[Event] = field(default_factory=list)
    refusal: str = ""


@dataclass
class DeclaredQueue:
    queue: ShardQueue
    declared_by: str


def describe(dataset: Dataset, num_shards: int, num_epochs: int, shuffle_seed: int | None) -> str:
    """A declaration in words, for the events and for the error of a conflicting one."""
    what = {"range": "sample indices", "files": "files", "seeds": "seeds"}[dataset.kind]
    if dataset.kind == FILES:
        what += f" ({dataset.files[0]} ...)"
    elif dataset.first_seed:
        what += f" from {dataset.first_seed}"
    order = "in order" if shuffle_seed is None else f"shuffled with seed {shuffle_seed}"
    return f"{dataset.size} {what} in {num_shards} shards, {num_epochs} epoch(s), {order}"


class ShardMaster:
    """The job's datasets by name. A worker is ``role:rank:incarnation`` (``ShardWorker.worker_id``)."""

    def __init__(self, queues: dict[str, DeclaredQueue] | None = None) -> None:
        self.queues: dict[str, DeclaredQueue] = queues or {}

    def call(self, req: sp.ShardWorker, plain_round: int | None = None) -> Answer:
        """Route a worker's call; ``plain_round``: the job has plain workers, running in this round."""
        events = self.release_older_rounds(plain_round) if plain_round is not None else []
        if isinstance(req, sp.ShardDeclare):
            answer = self.declare(req)
        elif isinstance(req, sp.ShardRequest):
            answer = self.request(req)
        elif isinstance(req, sp.ShardDone):
            answer = self.report(req)
        else:
            raise TypeError(f"not a shard call: {type(req).__name__}")
        answer.events = events + answer.events
        return answer

    def declare(self, req: sp.ShardDeclare) -> Answer:
        dataset = req.dataset.dataset()
        wanted = describe(dataset, req.num_shards, req.num_epochs, req.shuffle_seed)
        held = self.queues.get(req.name)
        if held is None:
            try:
                queue = ShardQueue(dataset, req.num_shards, req.num_epochs, req.shuffle_seed)
            except ConfigError as exc:
                return Answer(None, [], f"dataset {req.name!r} cannot be cut as declared by {req.worker_id}: {exc}")
            self.queues[req.name] = DeclaredQueue(queue, req.worker_id)
            event = Event("shards_declared", f"dataset {req.name}: {wanted}; declared by {req.worker_id}")
            return Answer(sp.ShardDeclared(name=req.name, declared_by=req.worker_id, first=True), [event])
        queue = held.queue
        if (queue.dataset, queue.num_shards, queue.num_epochs, queue.shuffle_seed) != \
                (dataset, req.num_shards, req.num_epochs, req.shuffle_seed):
            have = describe(queue.dataset, queue.num_shards, queue.num_epochs, queue.shuffle_seed)
            why = (f"dataset {req.name!r} was declared by {held.declared_by} as {have}, but {req.worker_id} "
                   f"declares it as {wanted}; declare it the same way in every process, or give it another name")
            return Answer(None, [Event("shards_conflict", why)], why)
        return Answer(sp.ShardDeclared(name=req.name, declared_by=held.declared_by, first=False))

    def request(self, req: sp.ShardRequest) -> Answer:
        held = self.queues.get(req.name)
        if held is None:
            return self._undeclared(req)
        grant, events = held.queue.request(req.worker_id)
        if grant.status != ASSIGNED or grant.shard is None:
            return Answer(sp.ShardGrant(status=grant.status, epoch=grant.epoch), events)  # type: ignore[arg-type]
        shard = grant.shard
        return Answer(sp.ShardGrant(status="assigned", epoch=grant.epoch, grant_id=grant.grant_id,
                                    shard_id=shard.shard_id, start=shard.start, stop=shard.stop), events)

    def report(self, req: sp.ShardDone) -> Answer:
        """Progress or done; a report the queue ignores (a grant the worker does not hold) is refused."""
        held = self.queues.get(req.name)
        if held is None:
            return self._undeclared(req)
        queue = held.queue
        if isinstance(req, sp.ShardProgress):
            events = queue.progress(req.worker_id, req.grant_id, req.trained_through)
        else:
            events = queue.done(req.worker_id, req.grant_id)
        ignored = [event.message for event in events if event.kind == "shard_report_ignored"]
        if ignored:
            return Answer(None, events, f"dataset {req.name!r}: {ignored[0]} (its shard went back to the queue: "
                                        "stop training it)")
        return Answer(sp.ShardAck(), events)

    def process_exited(self, role: str, rank: int, incarnation: int, why: str) -> list[Event]:
        """A worker process ended (failed, stopped, scaled away, its node lost, or finished): what it held and
        did not train goes back to the front of each queue."""
        worker_id = f"{role}:{rank}:{incarnation}"
        events: list[Event] = []
        for held in self.queues.values():
            events += held.queue.worker_lost(worker_id, why)
        return events

    def release_older_rounds(self, round_id: int) -> list[Event]:
        """Plain workers (no roles) all stop when the round changes: give back what workers of earlier rounds
        held."""
        events: list[Event] = []
        for held in self.queues.values():
            for worker_id in list(held.queue.held):
                role, _, incarnation = worker_id.rpartition(":")
                if role.startswith(f"{PLAIN_ROLE}:") and incarnation.isdigit() and int(incarnation) < round_id:
                    events += held.queue.worker_lost(worker_id, f"ended with round {incarnation}")
        return events

    def state_json(self) -> str:
        """Every queue's position, for the job's state file."""
        return json.dumps({name: {"declared_by": held.declared_by, "queue": held.queue.state()}
                           for name, held in sorted(self.queues.items())}, sort_keys=True)

    @classmethod
    def from_state_json(cls, text: str | None) -> ShardMaster:
        """The queues a previous master left (none when it declared none); a malformed state is a ConfigError."""
        if not text:
            return cls()
        try:
            listed: dict[str, Any] = json.loads(text)
            return cls({str(name): DeclaredQueue(ShardQueue.from_state(entry["queue"]), str(entry["declared_by"]))
                        for name, entry in listed.items()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"the shard queues in the job's state are malformed ({exc!r}); start the job "
                              "afresh") from exc

    def _undeclared(self, req: sp.ShardWorker) -> Answer:
        known = ", ".join(sorted(self.queues)) or "none"
        return Answer(None, [], f"dataset {req.name!r} is not declared (declared: {known}); call convoy.shards() "
                                "with the dataset before asking for its shards")
