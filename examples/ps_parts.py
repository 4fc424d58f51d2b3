"""The worker's side of ``train_ps.py``: connecting to the parameter servers (and following one that moved),
the first pull once the chief has set them up, the click model's logits from what was pulled, the epoch's
batches from the master's data shards, a batch's gradients pushed tagged, and the exactly-once count."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from dlrm_model import DenseArch
from torch.func import functional_call

import convoy
import convoy.worker.shards
from convoy.errors import ConfigError
from convoy.parallel.embedding.bags import TableSpec as BagSpec
from convoy.parallel.ps.client import PSClient, Pulled, Tally
from convoy.parallel.transport import TransportError

CONNECT_S = 60.0


def connect(placement, rank: int, staleness: int) -> PSClient:
    """A client once every server listens (they start just before the workers do). Each try asks for the servers'
    addresses as the agent publishes them now: a server started again since this worker started listens elsewhere,
    or not yet (its address empty meanwhile)."""
    deadline = time.monotonic() + CONNECT_S
    while True:
        try:
            return PSClient(placement, list(convoy.role().peers("ps")), f"worker{rank}", staleness,
                            follow=lambda: convoy.role().peers("ps"))
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def pull_when_set_up(client: PSClient, ids: dict[str, torch.Tensor]) -> Pulled:
    """The first pull of a worker other than the chief waits until the chief has given out the shards."""
    deadline = time.monotonic() + CONNECT_S
    while True:
        try:
            return client.pull(ids)
        except ConfigError as exc:
            if "holds no shard yet" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def logits_of(arch: DenseArch, bags: list[BagSpec], pulled: Pulled, batch, params: dict[str, torch.Tensor],
              rows: dict[str, torch.Tensor]) -> torch.Tensor:
    pooled = []
    for spec in bags:
        ids, offsets, _ = batch.features[spec.name]
        local = torch.searchsorted(pulled.ids[spec.name], ids)
        pooled.append(F.embedding_bag(local, rows[spec.name], offsets, mode=spec.pooling))
    return functional_call(arch, params, (batch.dense, torch.stack(pooled, 1)))


class BatchShards:
    """The epoch's batches, by seed, from the master's data shards. A batch counts as trained once every server
    has applied its push: after each pull, ``seen`` reports what the servers hold of the current shard, so a
    worker that fails gives back only the batches they do not have."""

    def __init__(self, client: PSClient, total: int, shard_batches: int) -> None:
        self.client, self.total = client, total
        self.stream = convoy.shards("train-batches", num_seeds=total, shard_size=shard_batches)
        self.shard: convoy.worker.shards.Shard | None = None
        self.applied_before: int | None = None
        self.pushed = self.reported = 0

    def __iter__(self) -> Iterator[int]:
        for shard in self.stream:
            self.shard, self.applied_before, self.pushed, self.reported = shard, None, 0, 0
            for index in shard.items:
                if shard.lost:
                    break
                yield index
                self.pushed += 1
            self.client.flush()  # every push of the shard applied: now all of it is trained
            shard.done()

    def seen(self, pulled: Pulled) -> bool:
        """Report this shard's batches every server has applied; False once the shard is no longer ours."""
        assert self.shard is not None
        applied = min(pulled.applied)
        self.applied_before = applied if self.applied_before is None else self.applied_before
        # a restored server holds fewer pushes until this worker's resends land: what was reported stays reported
        self.reported = max(self.reported, min(applied - self.applied_before, self.pushed))
        return self.shard.progress(self.reported)


def push_gradients(client: PSClient, arch: DenseArch, bags: list[BagSpec], batch, pulled: Pulled,
                   index: int) -> float:
    """One batch's loss and gradients from what was pulled, pushed tagged with the batch's index (a batch trained
    again, after its shard was given back, is applied once per server); returns the loss."""
    params = {n: t.requires_grad_() for n, t in pulled.dense.items()}
    rows = {n: t.requires_grad_() for n, t in pulled.rows.items()}
    loss = F.binary_cross_entropy_with_logits(logits_of(arch, bags, pulled, batch, params, rows), batch.labels)
    loss.backward()
    client.push({n: t.grad for n, t in params.items()}, {n: (pulled.ids[n], t.grad) for n, t in rows.items()},
                tag=index)
    return loss.item()


def exactly_once(tallies: list[Tally], batches: int) -> str:
    """The count behind "every batch trained exactly once": each server holds each batch's tag, and applied no
    push beyond one per tag it holds (its version counts every push it applied)."""
    problems = []
    for server, tally in enumerate(tallies):
        missing, outside = tally.exactly_once(batches)
        beyond = tally.version - len(tally.tags)
        if missing or outside or beyond:
            problems.append(f"server {server} lacks {len(missing)} batches {missing[:5]} and holds {len(outside)} "
                            f"outside the epoch {outside[:5]} and applied {beyond} pushes beyond one per batch it "
                            "holds")
    repeats = sum(t.duplicates for t in tallies)
    if problems:
        return f"batches NOT trained exactly once: {'; '.join(problems)}"
    return (f"exactly once: each of the {batches} batches applied once on each of {len(tallies)} servers "
            f"({repeats} repeated pushes skipped)")
