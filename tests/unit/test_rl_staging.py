"""Staging in scale mode: inserts enter the table as the learners' samples allow at the target samples per insert,
the rest wait in order (cut where a batch straddles), sized to some seconds of the table's intake; over the real
service a learner that stops sampling leaves the ratio where it was, nobody waits, and every transition enters the
table once; only a full staging makes an insert wait, and that is counted."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from convoy.parallel.transport import Credentials, Identity
from convoy.workloads.rl.buffer import Layout, ReplayBuffer
from convoy.workloads.rl.replay_client import ReplayClient
from convoy.workloads.rl.replay_service import ReplayService
from convoy.workloads.rl.staging import Staging


def batch(first: int, count: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(first, first + count)
    return {"obs": ids.float().unsqueeze(1).repeat(1, 4), "action": ids % 2, "reward": ids.float(),
            "next_obs": ids.float().unsqueeze(1).repeat(1, 4), "discount": torch.full((count,), 0.9)}


def test_staging_gives_the_oldest_rows_in_order_cutting_a_batch_and_is_sized_to_the_tables_intake() -> None:
    staging = Staging(limit=25)
    staging.push("a", batch(0, 10), 10)
    staging.push("b", batch(100, 10), 10)
    taken = staging.take(15)
    assert [(source, rows) for source, _, rows in taken] == [("a", 10), ("b", 5)]
    assert taken[1][1]["reward"].tolist() == [100, 101, 102, 103, 104]
    assert staging.rows == 5 and staging.take(99)[0][1]["reward"].tolist() == [105, 106, 107, 108, 109]
    # target 4, one learner batch (64) of slack: 400 samples allow (400 + 64) // 4 = 116 rows in all
    assert Staging(limit=1000).due(inserted=100, sampled=400, target=4.0, slack=64) == 0, "nothing staged, none due"
    full = Staging(limit=1000)
    full.push("a", batch(0, 50), 50)
    assert full.due(inserted=100, sampled=400, target=4.0, slack=64) == 16
    sized = Staging(limit=1)
    sized.size_for(0.0, 500.0, capacity=50_000)
    assert sized.limit == 5000, "10 s of the table's intake"
    sized.size_for(5.0, 0.0, capacity=50_000)
    assert sized.limit == 5000, "a stall (no intake) does not shrink it: that is when it is needed"
    sized.size_for(40.0, 1.0, capacity=50_000)
    assert sized.limit == 1024, "30 s on, the floor"
    sized.size_for(80.0, 0.0, capacity=50_000)
    assert sized.limit == 12_500, "no intake measured at all: as much room as it may have"
    sized.size_for(41.0, 1e6, capacity=50_000)
    assert sized.limit == 12_500, "at most a quarter of the capacity"
    assert sized.fits(12_500) and not Staging(limit=10, rows=5).fits(6) and Staging(limit=10).fits(99), \
        "a batch larger than the limit fits an empty staging (it would never fit otherwise)"


@contextmanager
def served(stage_rows: int) -> Iterator[tuple[ReplayService, ReplayClient, ReplayClient]]:
    """A scale-mode service with staging of a fixed size, and an actor and a learner connected to it."""
    secret = Credentials.fresh()
    service = ReplayService(ReplayBuffer(Layout.for_dqn((4,)), capacity=10_000), credentials=secret,
                            stage_rows=stage_rows)
    actor = ReplayClient(lambda: service.address, secret.as_process(Identity("actor", 0, 1)), find_s=5)
    learner = ReplayClient(lambda: service.address, secret.as_process(Identity("learner", 0, 1)), find_s=5)
    try:
        yield service, actor, learner
    finally:
        actor.close()
        learner.close()
        service.close()


def test_a_learner_that_stops_sampling_leaves_the_ratio_and_every_transition_enters_once() -> None:
    with served(stage_rows=2500) as (service, actor, learner):
        actor.insert(batch(0, 200))  # before the first paced sample: straight into the table
        for _ in range(10):
            learner.sample(64, target=4.0)
        stats = service.stats()
        before = (int(stats["inserted"]), int(stats["sampled"]))
        for first in range(200, 2200, 100):  # the learner stalls while the actor goes on
            reply = actor.insert(batch(first, 100))
            assert reply["have"] == first + 100, "every insert is answered at once: nobody waits"
        stats = service.stats()
        slack = (160 + 64) // 4  # 10 requests got 16 each (nothing owed yet); one batch of room: 56 rows
        assert (int(stats["inserted"]), int(stats["sampled"])) == (before[0] + slack, before[1]), \
            "no samples, so no more than the slack enters the table"
        assert stats["staged"] == 2000 - slack and stats["received"] == 2200 and stats["waited_insert_s"] == 0
        for _ in range(40):  # it resumes at its own batch, and the staged rows enter as the samples allow
            reply = learner.sample(64, target=4.0)
            assert reply is not None and len(reply.tensors["action"]) == 64, "a backlog is no debt to pay"
            stats = service.stats()
            # counted from where pacing began (200 in, none sampled): as many in as the samples allow, no fewer
            admitted, sampled = int(stats["inserted"]) - 200, int(stats["sampled"])
            assert 4 * admitted <= sampled + 64, (admitted, sampled)
            if stats["staged"]:
                assert sampled + 64 < 4 * (admitted + 1) + 64, (admitted, sampled)
        assert stats["staged"] < 2000 - slack
        while int(service.stats()["staged"]):
            learner.sample(64, target=4.0)
        stats = service.stats()
        assert stats["inserted"] == 2200 and stats["by_source"] == {"actor0.1": 2200} and stats["duplicates"] == 0


def test_with_staging_full_an_insert_waits_for_room_and_the_wait_is_counted() -> None:
    """Actors faster than the learners with no scaling left: the last resort is the throttle's, counted."""
    with served(stage_rows=100) as (service, actor, learner):
        actor.insert(batch(0, 100))
        learner.sample(16, target=4.0)  # pacing begins: from here inserts are staged
        actor.insert(batch(100, 100))
        assert service.stats()["staged"] > 0
        done = threading.Event()
        later = threading.Thread(target=lambda: (actor.insert(batch(200, 100)), done.set()))
        later.start()
        assert not done.wait(0.5), "the staging is full: the insert waits"
        while not done.is_set():
            learner.sample(64, target=4.0)
        later.join()
        stats = service.stats()
        assert float(stats["waited_insert_s"]) >= 0.5 and stats["received"] == 300  # type: ignore[arg-type]
