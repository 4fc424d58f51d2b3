"""Dynamic data shards: the dataset cut into shards that the master hands to workers on request.

A worker that fails or is removed gives its unfinished part of a shard back to the queue, so each sample is
trained exactly once per epoch through faults and scaling. Pure (no I/O, no clock); every call returns the
events it caused, as ``Job`` does, and ``state()``/``from_state()`` carry the position across a master restart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from convoy.control.job import Event
from convoy.control.protocol.shards import FILES, SEEDS, Dataset
from convoy.errors import ConfigError

ASSIGNED, WAIT, FINISHED = "assigned", "wait", "finished"
STATE_VERSION = 1


@dataclass(frozen=True)
class Shard:
    """Items ``[start, stop)`` of the dataset; ``start`` moves forward as a holder reports progress, so a
    re-queued shard holds only what was not trained yet. ``shard_id`` stays the same through re-queues."""

    shard_id: int
    start: int
    stop: int

    @property
    def num_items(self) -> int:
        return self.stop - self.start

    def items(self, dataset: Dataset) -> list[int] | list[str]:
        """The sample indices, file names or seeds this shard stands for."""
        if dataset.kind == FILES:
            return list(dataset.files[self.start:self.stop])
        offset = dataset.first_seed if dataset.kind == SEEDS else 0
        return list(range(offset + self.start, offset + self.stop))


@dataclass(frozen=True)
class Grant:
    """The answer to a request: a shard (``assigned``), nothing yet because other workers hold the rest of the
    epoch and may give it back (``wait``), or nothing ever (``finished``: every epoch is done)."""

    status: str
    epoch: int
    shard: Shard | None = None
    grant_id: int = -1
    """Names this hand-out; reports carry it, so a report of an earlier holding of the same shard (by a worker
    since declared lost and restarted under the same id) cannot count."""


def cut(dataset: Dataset, num_shards: int) -> list[Shard]:
    """Contiguous shards of near-equal size (the first ``size % num_shards`` one item larger)."""
    dataset.validate()
    if num_shards <= 0:
        raise ConfigError(f"num_shards is {num_shards}; the dataset must be cut into at least 1 shard")
    if num_shards > dataset.size:
        raise ConfigError(f"cannot cut {dataset.size} {dataset.kind} items into {num_shards} shards; "
                          f"use at most {dataset.size} shards")
    base, extra = divmod(dataset.size, num_shards)
    shards, start = [], 0
    for shard_id in range(num_shards):
        stop = start + base + (1 if shard_id < extra else 0)
        shards.append(Shard(shard_id, start, stop))
        start = stop
    return shards


@dataclass
class ShardQueue:
    """Hands shards out one epoch at a time; a worker holds at most one shard.

    Defined outcomes: a request from a worker that already holds a shard returns that same grant (a retried
    request whose reply was lost leaks nothing); a progress or done report for a grant the worker does not hold
    (its shard was re-queued after the worker was declared lost, or the grant id is unknown or of an earlier
    epoch) is ignored and returns one ``shard_report_ignored`` event, so a late report never counts a sample twice.
    """

    dataset: Dataset
    num_shards: int
    num_epochs: int = 1
    shuffle_seed: int | None = None
    """None: shards go out in order; else each epoch's order is shuffled with ``shuffle_seed + epoch``."""
    epoch: int = 0
    pending: list[Shard] = field(default_factory=list)
    held: dict[str, Grant] = field(default_factory=dict)
    """worker id -> what it holds (the shard's ``start`` at its last reported progress)."""
    next_grant_id: int = 0
    done_ids: set[int] = field(default_factory=set)
    samples_trained: int = 0
    """Items of the current epoch covered by accepted reports."""

    def __post_init__(self) -> None:
        if self.num_epochs <= 0:
            raise ConfigError(f"num_epochs is {self.num_epochs}; train at least 1 epoch")
        self._shards = cut(self.dataset, self.num_shards)
        if not self.pending and not self.held and not self.done_ids and self.epoch == 0:
            self.pending = self._epoch_order(0)

    @property
    def finished(self) -> bool:
        return self.epoch >= self.num_epochs

    def request(self, worker_id: str) -> tuple[Grant, list[Event]]:
        """A worker asks for work."""
        if self.finished:
            return Grant(FINISHED, self.epoch), []
        if worker_id in self.held:
            return self.held[worker_id], []
        if not self.pending:
            return Grant(WAIT, self.epoch), []
        shard = self.pending.pop(0)
        grant = Grant(ASSIGNED, self.epoch, shard, self.next_grant_id)
        self.next_grant_id += 1
        self.held[worker_id] = grant
        event = Event("shard_assigned", f"epoch {self.epoch}: shard {shard.shard_id} items [{shard.start}, "
                                        f"{shard.stop}) to worker {worker_id} (grant {grant.grant_id})")
        return grant, [event]

    def progress(self, worker_id: str, grant_id: int, trained_through: int) -> list[Event]:
        """The worker has trained its shard's items up to ``trained_through`` (exclusive); a loss re-queues
        only the rest. Reports that move backwards or past the shard's end are ignored."""
        grant = self._held_grant(worker_id, grant_id)
        if isinstance(grant, Event):
            return [grant]
        shard = grant.shard
        assert shard is not None
        if not shard.start <= trained_through <= shard.stop:
            return [self._ignored(worker_id, f"progress to item {trained_through} is outside its shard "
                                             f"{shard.shard_id}'s untrained items [{shard.start}, {shard.stop})")]
        self.samples_trained += trained_through - shard.start
        moved = Shard(shard.shard_id, trained_through, shard.stop)
        self.held[worker_id] = Grant(ASSIGNED, grant.epoch, moved, grant.grant_id)
        return []

    def done(self, worker_id: str, grant_id: int) -> list[Event]:
        """The worker trained all of its shard; the epoch ends when every shard is done."""
        grant = self._held_grant(worker_id, grant_id)
        if isinstance(grant, Event):
            return [grant]
        shard, epoch = grant.shard, self.epoch
        assert shard is not None
        del self.held[worker_id]
        self.samples_trained += shard.num_items
        self.done_ids.add(shard.shard_id)
        events = [Event("shard_done", f"epoch {epoch}: worker {worker_id} finished shard {shard.shard_id}")]
        if len(self.done_ids) == self.num_shards:
            events.append(Event("epoch_done", f"epoch {epoch} done: {self.samples_trained} of {self.dataset.size} "
                                              "items trained once each", console=True))
            self.epoch += 1
            self.done_ids, self.samples_trained = set(), 0
            self.pending = self._epoch_order(self.epoch) if not self.finished else []
        return events

    def worker_lost(self, worker_id: str, why: str = "failed") -> list[Event]:
        """A worker failed or was removed (scaled down): what it had not trained goes to the front of the
        queue. A worker that held nothing causes no event."""
        grant = self.held.pop(worker_id, None)
        if grant is None or grant.shard is None:
            return []
        shard = grant.shard
        if shard.num_items == 0:  # it trained everything but the done report never came: count it done
            self.held[worker_id] = grant
            return self.done(worker_id, grant.grant_id)
        self.pending.insert(0, shard)
        return [Event("shard_requeued", f"epoch {self.epoch}: worker {worker_id} {why}; shard {shard.shard_id} "
                                        f"items [{shard.start}, {shard.stop}) back in the queue", console=True)]

    def state(self) -> dict[str, Any]:
        """The position, JSON-ready: enough to go on after a master restart."""
        return {
            "version": STATE_VERSION,
            "dataset": {"kind": self.dataset.kind, "size": self.dataset.size, "files": list(self.dataset.files),
                        "first_seed": self.dataset.first_seed},
            "num_shards": self.num_shards, "num_epochs": self.num_epochs, "shuffle_seed": self.shuffle_seed,
            "epoch": self.epoch,
            "pending": [[s.shard_id, s.start, s.stop] for s in self.pending],
            "held": {worker: [g.grant_id, g.shard.shard_id, g.shard.start, g.shard.stop]
                     for worker, g in self.held.items() if g.shard is not None},
            "next_grant_id": self.next_grant_id,
            "done_ids": sorted(self.done_ids), "samples_trained": self.samples_trained,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ShardQueue:
        """Rebuild a queue from ``state()``; a state of another version or an inconsistent one is refused."""
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"shard queue state version {state.get('version')!r} is not {STATE_VERSION}; "
                              "it was written by another convoy version: start the job afresh")
        try:
            data = state["dataset"]
            queue = cls(Dataset(data["kind"], int(data["size"]), tuple(data["files"]), int(data["first_seed"])),
                        int(state["num_shards"]), int(state["num_epochs"]), state["shuffle_seed"],
                        epoch=int(state["epoch"]),
                        pending=[Shard(*map(int, s)) for s in state["pending"]],
                        held={str(w): Grant(ASSIGNED, int(state["epoch"]), Shard(*map(int, g[1:])), int(g[0]))
                              for w, g in state["held"].items()},
                        next_grant_id=int(state["next_grant_id"]),
                        done_ids={int(i) for i in state["done_ids"]},
                        samples_trained=int(state["samples_trained"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"shard queue state is incomplete or malformed ({exc!r}); start the job afresh") \
                from exc
        queue._check_consistent()
        return queue

    def _check_consistent(self) -> None:
        if self.finished:
            return
        open_ids = [s.shard_id for s in self.pending] + [g.shard.shard_id for g in self.held.values() if g.shard]
        every = sorted(open_ids + sorted(self.done_ids))
        if every != list(range(self.num_shards)):
            raise ConfigError(f"shard queue state does not account for each of its {self.num_shards} shards once "
                              "(pending, held, done); start the job afresh")

    def _epoch_order(self, epoch: int) -> list[Shard]:
        order = list(self._shards)
        if self.shuffle_seed is not None:
            random.Random(self.shuffle_seed + epoch).shuffle(order)
        return order

    def _held_grant(self, worker_id: str, grant_id: int) -> Grant | Event:
        grant = self.held.get(worker_id)
        if grant is None or grant.grant_id != grant_id:
            holds = f"holds grant {grant.grant_id}" if grant else "holds no shard"
            return self._ignored(worker_id, f"it reported grant {grant_id} but {holds}")
        return grant

    def _ignored(self, worker_id: str, why: str) -> Event:
        return Event("shard_report_ignored", f"ignored a shard report from worker {worker_id}: {why}")
