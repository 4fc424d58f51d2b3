"""The replay service over the real role transport: inserts land exactly once across a restart of the buffer from
its snapshot (counted end to end), a malformed insert is refused whole and counted, the throttle makes the faster
side wait and counts it, weights go by version, slices by the caller's rank, and a stranger gets nothing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from convoy.errors import ConfigError
from convoy.parallel.transport import Connection, Credentials, Identity, Message, Refused
from convoy.workloads.rl.buffer import Layout, ReplayBuffer
from convoy.workloads.rl.rates import Throttle
from convoy.workloads.rl.replay_client import ReplayClient
from convoy.workloads.rl.replay_service import ReplayService
from convoy.workloads.rl.replay_snapshots import BufferSnapshots

LAYOUT = Layout.for_dqn((4,))


def transitions(first: int, count: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(first, first + count)
    return {"obs": ids.float().unsqueeze(1).repeat(1, 4), "action": ids, "reward": ids.float(),
            "next_obs": ids.float().unsqueeze(1).repeat(1, 4), "discount": torch.full((count,), 0.9)}


@pytest.fixture
def secret() -> Credentials:
    return Credentials.fresh()


def serve(credentials: Credentials, segment: Path | None = None, **kwargs: object) -> ReplayService:
    snapshots = BufferSnapshots(segment) if segment is not None else None
    restored = snapshots.restore() if snapshots is not None else None
    buffer = restored[0] if restored is not None else ReplayBuffer(LAYOUT, capacity=10_000)
    return ReplayService(buffer, snapshots=snapshots, credentials=credentials,  # type: ignore[arg-type]
                         kept=restored[1] if restored is not None else None, **kwargs)


def client_of(service: ReplayService, credentials: Credentials, rank: int = 0, role: str = "actor") -> ReplayClient:
    me = credentials.as_process(Identity(role, rank, 1))
    return ReplayClient(lambda: service.address, me, find_s=5.0)


def test_inserts_land_once_across_a_restart_of_the_buffer_from_its_snapshot(tmp_path: Path,
                                                                           secret: Credentials) -> None:
    segment = tmp_path / "replay0"
    first = serve(secret, segment, snapshot_every_s=3600)
    actor = client_of(first, secret)
    for batch in range(5):
        actor.insert(transitions(batch * 10, 10), returns=[float(batch)], env_steps=10)
    first.take_snapshot()
    actor.insert(transitions(50, 10), env_steps=10)  # kept by the client: the snapshot is older
    assert [entry[0] for entry in actor.unkept] == [50]  # the snapshot holds the first 50
    first.close()  # the buffer dies; what it took after its snapshot dies with it

    second = serve(secret, segment, snapshot_every_s=3600)  # comes back from the snapshot, at a new port
    actor.find = lambda: second.address
    actor.insert(transitions(60, 10), env_steps=10)
    stats = second.stats()
    assert stats["inserted"] == 70 and stats["duplicates"] == 0 and actor.lost == 0
    assert stats["env_steps"] == 70 and stats["episodes"] == 5
    ids = sorted(set(second.buffer.sample(5000).batch["action"].tolist()))
    assert ids == list(range(70)), "each transition inserted is in the buffer exactly once"
    assert second.buffer.counters.by_source == {"actor0.1": 70}
    second.close()


def test_a_buffer_that_lost_what_the_actor_no_longer_holds_counts_it(tmp_path: Path, secret: Credentials) -> None:
    first = serve(secret, tmp_path / "a", snapshot_every_s=3600)
    actor = client_of(first, secret)
    actor.insert(transitions(0, 10))
    actor.unkept.clear()  # as if the batch had been reported kept, then the segment was lost with its node
    first.close()
    second = serve(secret, tmp_path / "b", snapshot_every_s=3600)  # another segment: nothing to restore
    actor.find = lambda: second.address
    actor.insert(transitions(10, 5))
    assert actor.lost == 10 and second.stats()["inserted"] == 5
    second.close()


def test_a_malformed_insert_is_refused_whole_and_counted(secret: Credentials) -> None:
    service = serve(secret)
    actor = client_of(service, secret)
    actor.insert(transitions(0, 4))
    bad = transitions(4, 4)
    bad["obs"] = torch.zeros(4, 3)
    with pytest.raises(ConfigError, match=r"malformed transitions refused: column 'obs' must be torch.float32 of "
                                          r"shape \[n, \[4\]\]"):
        actor.call(Message("insert", {"first": 4}, bad))
    stats = service.stats()
    assert stats["refused"] == 1 and stats["inserted"] == 4 and stats["size"] == 4
    actor.insert(transitions(4, 4))  # the same connection goes on
    assert service.stats()["inserted"] == 8
    service.close()


def test_a_stranger_gets_nothing(secret: Credentials) -> None:
    service = serve(secret)
    with pytest.raises(Refused):
        Connection(service.address, credentials=Credentials.fresh(Identity("actor", 0, 1)))
    assert service.stats()["inserted"] == 0
    service.close()


def test_the_throttle_makes_the_faster_side_wait_and_counts_it(secret: Credentials) -> None:
    service = serve(secret, throttle=Throttle(target=2.0, min_size=10, error=8.0))
    actor = client_of(service, secret)
    learner = client_of(service, secret, rank=1, role="learner")
    actor.insert(transitions(0, 10))
    assert learner.sample(4) is not None  # balance 20 - 4 >= 20 - 8
    assert learner.sample(4) is not None  # 20 - 8 >= 12
    done = threading.Event()

    def sample_more() -> None:
        learner.sample(4)  # 20 - 12 < 12: waits for an insert
        done.set()

    thread = threading.Thread(target=sample_more)
    thread.start()
    deadline = time.monotonic() + 10
    while service.stats()["waiting"] != 1:  # the sample is held at the service
        assert time.monotonic() < deadline, "the sample never reached the throttle"
        time.sleep(0.01)
    time.sleep(0.3)
    assert not done.is_set(), "the sample should wait for inserts"
    actor.insert(transitions(10, 2))
    thread.join(5)
    assert done.is_set()
    stats = service.stats()
    assert stats["waited_sample_s"] >= 0.3 and stats["sampled"] == 12 and stats["waiting"] == 0
    with pytest.raises(ConfigError, match=r"the throttle's band \(16 samples wide\) can never let a sample of 17 "
                                          r"through: raise throttle_error to at least 8.5"):
        learner.sample(17)
    service.close()


def test_weights_go_by_version_and_slices_by_rank(secret: Credentials) -> None:
    service = serve(secret)
    learner, actor = client_of(service, secret, rank=0, role="learner"), client_of(service, secret, rank=3)
    assert actor.get_weights(0) is None
    with pytest.raises(ConfigError, match="actor 3 .*may not put weights: only the learners train them"):
        actor.put_weights(5, {"w": torch.zeros(3)})
    learner.put_weights(2, {"w": torch.ones(3)})
    learner.put_weights(1, {"w": torch.zeros(3)})  # older: ignored
    version, tensors = actor.get_weights(0)  # type: ignore[misc]
    assert version == 2 and torch.equal(tensors["w"], torch.ones(3))
    assert actor.get_weights(2) is None
    learner.put_deal({0: (0, 1), 3: (2, 5)})
    assert actor.get_slices() == (1, [2, 5])
    learner.put_deal({0: (0, 1), 3: (2, 5)})  # the same deal again: the same version
    assert actor.get_slices() == (1, [2, 5])
    service.close()


def test_rates_are_measured_over_the_window(secret: Credentials) -> None:
    service = serve(secret, window_s=1.0)
    actor = client_of(service, secret)
    for batch in range(10):
        actor.insert(transitions(batch * 20, 20))
        actor.sample(40)
        time.sleep(0.1)
    time.sleep(0.3)
    stats = service.stats()
    assert stats["inserts_per_s"] > 0 and stats["samples_per_s"] > 0
    assert 1.5 <= stats["samples_per_s"] / stats["inserts_per_s"] <= 2.5  # type: ignore[operator]
    service.close()


def test_new_priorities_ride_on_the_next_sample_and_are_applied_before_it_is_drawn(secret: Credentials) -> None:
    service = ReplayService(ReplayBuffer(LAYOUT, capacity=100, alpha=1.0, seed=0), credentials=secret)
    client_of(service, secret).insert(transitions(0, 10))
    learner = client_of(service, secret, role="learner")
    first = learner.sample(10)
    assert first is not None
    slots, written = first.tensors["_slots"], first.tensors["_written"]
    wanted = torch.where(first.tensors["action"] == 7, 1.0, 0.0)  # all the priority on transition 7
    second = learner.sample(32, updated={"slots": slots, "written": written, "priorities": wanted})
    assert second is not None and set(second.tensors["action"].tolist()) == {7}
    with pytest.raises(ConfigError, match="priorities need the tensors slots, written and priorities"):
        learner.call(Message("sample", {"count": 4}, {"slots": slots}))
    service.close()
