"""convoy.control.shards.queue: exactly once per epoch through failures, scaling, late reports and master restarts."""

from __future__ import annotations

import json
import random

import pytest

from convoy.control.shards.queue import ASSIGNED, FINISHED, WAIT, Dataset, Grant, Shard, ShardQueue, cut
from convoy.errors import ConfigError


def test_cut_covers_the_dataset_once_in_near_equal_contiguous_shards() -> None:
    shards = cut(Dataset.index_range(10), 3)
    assert [(s.start, s.stop) for s in shards] == [(0, 4), (4, 7), (7, 10)]
    files = Dataset.file_list(["a", "b", "c"])
    assert [s.items(files) for s in cut(files, 2)] == [["a", "b"], ["c"]]
    seeds = Dataset.seed_space(4, first_seed=100)
    assert [s.items(seeds) for s in cut(seeds, 2)] == [[100, 101], [102, 103]]


@pytest.mark.parametrize("dataset, num_shards, words", [
    (Dataset.index_range(10), 0, "at least 1 shard"),
    (Dataset.index_range(10), -2, "at least 1 shard"),
    (Dataset.index_range(3), 4, "at most 3 shards"),
    (Dataset.index_range(0), 1, "empty"),
    (Dataset.file_list([]), 1, "empty"),
    (Dataset("rows", 5), 1, "unknown"),
])
def test_bad_cuts_are_refused_with_what_to_do(dataset: Dataset, num_shards: int, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ShardQueue(dataset, num_shards)


def test_zero_epochs_are_refused() -> None:
    with pytest.raises(ConfigError, match="at least 1 epoch"):
        ShardQueue(Dataset.index_range(4), 2, num_epochs=0)


def test_a_lost_worker_gives_back_only_what_it_did_not_train() -> None:
    queue = ShardQueue(Dataset.index_range(100), 4)
    grant, events = queue.request("w0")
    assert grant.status == ASSIGNED and grant.shard == Shard(0, 0, 25) and events[0].kind == "shard_assigned"
    assert queue.progress("w0", grant.grant_id, 10) == []
    events = queue.worker_lost("w0")
    assert [e.kind for e in events] == ["shard_requeued"] and "[10, 25)" in events[0].message
    again, _ = queue.request("w1")
    assert again.shard == Shard(0, 10, 25), "the remainder goes out first, under the same shard id"
    assert again.grant_id != grant.grant_id


def test_a_repeated_request_returns_the_same_grant() -> None:
    queue = ShardQueue(Dataset.index_range(8), 4)
    first, _ = queue.request("w0")
    second, events = queue.request("w0")
    assert second == first and events == []
    assert len(queue.pending) == 3


def test_reports_the_worker_does_not_hold_are_ignored_and_count_nothing() -> None:
    queue = ShardQueue(Dataset.index_range(8), 2)
    grant, _ = queue.request("w0")
    queue.worker_lost("w0")
    regrant, _ = queue.request("w0")  # the same worker id restarted: holds the same shard under a new grant
    assert regrant.shard == grant.shard
    for events in (queue.done("w0", grant.grant_id), queue.progress("w0", grant.grant_id, 2),
                   queue.done("w9", regrant.grant_id), queue.done("w0", 12345)):
        assert [e.kind for e in events] == ["shard_report_ignored"]
    assert queue.samples_trained == 0 and queue.done_ids == set()
    backwards = queue.progress("w0", regrant.grant_id, 5)
    assert [e.kind for e in backwards] == ["shard_report_ignored"] and "outside" in backwards[0].message
    assert queue.done("w0", regrant.grant_id)[0].kind == "shard_done"


def test_wait_while_others_hold_the_rest_of_the_epoch_then_finished() -> None:
    queue = ShardQueue(Dataset.index_range(4), 2, num_epochs=2)
    a, _ = queue.request("a")
    b, _ = queue.request("b")
    assert queue.request("c")[0] == Grant(WAIT, 0)
    queue.done("a", a.grant_id)
    events = queue.done("b", b.grant_id)
    assert [e.kind for e in events] == ["shard_done", "epoch_done"] and queue.epoch == 1
    for worker in ("a", "b"):
        grant, _ = queue.request(worker)
        queue.done(worker, grant.grant_id)
    assert queue.finished and queue.request("a")[0].status == FINISHED


def test_a_worker_lost_after_training_everything_counts_its_shard_done() -> None:
    queue = ShardQueue(Dataset.index_range(4), 1)
    grant, _ = queue.request("w0")
    queue.progress("w0", grant.grant_id, 4)
    kinds = [e.kind for e in queue.worker_lost("w0")]
    assert kinds == ["shard_done", "epoch_done"] and queue.finished


def test_state_round_trip_mid_epoch_through_json() -> None:
    queue = ShardQueue(Dataset.file_list([f"part-{i}" for i in range(7)]), 3, num_epochs=2, shuffle_seed=5)
    grant, _ = queue.request("w0")
    queue.progress("w0", grant.grant_id, grant.shard.start + 1)
    other, _ = queue.request("w1")
    queue.done("w1", other.grant_id)
    restored = ShardQueue.from_state(json.loads(json.dumps(queue.state())))
    assert restored.state() == queue.state()
    assert restored.held == queue.held and restored.pending == queue.pending
    assert restored.request("w0")[0] == queue.request("w0")[0], "the holder goes on with the same grant"
    assert restored.request("w2")[0] == queue.request("w2")[0]


@pytest.mark.parametrize("change, words", [
    (lambda s: s.update(version=99), "version"),
    (lambda s: s.pop("pending"), "malformed"),
    (lambda s: s.update(done_ids=[0, 0]), "each of its"),
])
def test_a_bad_state_is_refused(change, words: str) -> None:
    queue = ShardQueue(Dataset.index_range(6), 3)
    queue.request("w0")
    state = queue.state()
    change(state)
    with pytest.raises(ConfigError, match=words):
        ShardQueue.from_state(state)


def _run_schedule(seed: int) -> tuple[int, int]:
    """One random life of a job: workers come, go and fail, report progress in random steps, send late reports
    of earlier grants, and the master restarts from its state; every item must be counted once per epoch."""
    rng = random.Random(seed)
    size, num_shards, num_epochs = rng.randint(1, 60), 0, rng.randint(1, 3)
    num_shards = rng.randint(1, size)
    queue = ShardQueue(Dataset.index_range(size), num_shards, num_epochs, rng.choice([None, seed]))
    counts = [[0] * size for _ in range(num_epochs)]
    workers = {f"w{i}": None for i in range(rng.randint(1, 4))}  # worker -> (grant, trained through) it believes
    stale: list[tuple[str, Grant, int]] = []
    next_worker, steps = len(workers), 0
    faults = 0
    while not queue.finished:
        steps += 1
        assert steps < 20000, f"schedule {seed} does not finish"
        action = rng.random()
        if action < 0.04 and len(workers) > 1:  # scale down or fail
            worker = rng.choice(sorted(workers))
            if workers[worker] is not None:
                stale.append((worker, workers[worker][0], workers[worker][1]))
            queue.worker_lost(worker, rng.choice(["failed", "removed"]))
            faults += 1
            if rng.random() < 0.5:
                del workers[worker]
            else:
                workers[worker] = None  # restarted under the same id
            continue
        if action < 0.07:
            workers[f"w{next_worker}"] = None
            next_worker += 1
            continue
        if action < 0.09 and stale:  # a report of an earlier holding arrives late
            worker, grant, through = stale.pop(rng.randrange(len(stale)))
            events = queue.done(worker, grant.grant_id) if rng.random() < 0.5 else \
                queue.progress(worker, grant.grant_id, min(through + 1, grant.shard.stop))
            assert [e.kind for e in events] == ["shard_report_ignored"]
            continue
        if action < 0.11:
            queue = ShardQueue.from_state(json.loads(json.dumps(queue.state())))
            continue
        worker = rng.choice(sorted(workers))
        held = workers[worker]
        if held is None:
            grant, _ = queue.request(worker)
            if grant.status == ASSIGNED:
                workers[worker] = (grant, grant.shard.start)
            continue
        grant, through = held
        epoch = queue.epoch
        if rng.random() < 0.5:
            target = rng.randint(through, grant.shard.stop)
            assert queue.progress(worker, grant.grant_id, target) == []
            for item in range(through, target):
                counts[epoch][item] += 1
            workers[worker] = (grant, target)
        else:
            events = queue.done(worker, grant.grant_id)
            assert events[0].kind == "shard_done"
            for item in range(through, grant.shard.stop):
                counts[epoch][item] += 1
            workers[worker] = None
            if events[-1].kind == "epoch_done":
                assert counts[epoch] == [1] * size, f"schedule {seed}, epoch {epoch}: {counts[epoch]}"
    assert counts == [[1] * size for _ in range(num_epochs)], f"schedule {seed}"
    return faults, steps


def test_every_item_is_trained_exactly_once_per_epoch_over_many_random_schedules() -> None:
    total_faults = 0
    for seed in range(400):
        faults, _ = _run_schedule(seed)
        total_faults += faults
    assert total_faults > 400, "the schedules did exercise failures and removals"
