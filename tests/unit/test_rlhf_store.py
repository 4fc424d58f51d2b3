"""The sample store's staleness rule and accounting: with k = 0 a trainer takes only groups of its own version, with
k = 1 also the one before; older ones are dropped when found and counted by version, never handed out; groups of
an unpublished version, or past the capacity, are refused and counted; every group put is accounted for."""

from __future__ import annotations

import random

import pytest

from convoy.errors import ConfigError
from convoy.workloads.rlhf.store import FULL, KEPT, STALE, UNKNOWN, SampleStore


def test_synchronous_k0_takes_only_the_current_version() -> None:
    store = SampleStore(capacity=10, max_lag=0)
    store.publish(1)
    assert [store.put(1, f"a{i}") for i in range(3)] == [KEPT] * 3
    store.publish(2)
    assert store.put(2, "b0") == KEPT
    taken = store.take(5, current=2)
    assert [g.payload for g in taken] == ["b0"], "the version-1 groups are stale at version 2 with k = 0"
    stats = store.stats()
    assert stats["by_version"]["1"] == {"put": 3, "taken": 0, "dropped_stale": 3, "refused_full": 0}
    assert stats["by_version"]["2"]["taken"] == 1 and stats["held"] == 0


def test_the_groups_taken_at_the_published_version_are_counted_until_the_next_version() -> None:
    """What the store's lease rule reads: the current step's groups already taken, from 0 again at each version (a
    trainer taking at a newer version publishes it; one taking at an older version does not count)."""
    store = SampleStore(capacity=10, max_lag=1)
    for i in range(5):
        store.put(0, f"a{i}")
    assert len(store.take(2, current=0)) == 2 and store.taken_now == 2
    store.publish(0)
    assert store.taken_now == 2, "the same version again: still its step"
    assert len(store.take(1, current=1)) == 1 and (store.published, store.taken_now) == (1, 1)
    store.take(1, current=0)
    assert store.taken_now == 1, "a take at an older version is not this step's"
    store.publish(2)
    assert store.taken_now == 0


def test_asynchronous_k1_takes_one_version_back_and_drops_two_back() -> None:
    store = SampleStore(capacity=10, max_lag=1)
    for version in (1, 2, 3):
        store.publish(version)
        store.put(version, f"v{version}")
    taken = store.take(10, current=3)
    assert [g.version for g in taken] == [2, 3]
    assert store.stats()["by_version"]["1"]["dropped_stale"] == 1
    store.publish(4)
    assert store.put(2, "late") == STALE, "made by a version already 2 behind: dropped at once, counted"
    assert store.stats()["by_version"]["2"]["dropped_stale"] == 1


def test_a_group_of_an_unpublished_version_is_refused() -> None:
    store = SampleStore(capacity=4, max_lag=1)
    store.publish(3)
    assert store.put(4, "from the future") == UNKNOWN and store.put(-1, "negative") == UNKNOWN
    assert store.stats()["refused_unknown"] == 2 and store.stats()["held"] == 0


def test_a_full_store_drops_its_stale_groups_before_it_refuses() -> None:
    store = SampleStore(capacity=2, max_lag=0)
    store.publish(1)
    assert [store.put(1, "a"), store.put(1, "b"), store.put(1, "c")] == [KEPT, KEPT, FULL]
    store.publish(2)
    assert store.put(2, "d") == KEPT, "the version-1 groups were stale: room made"
    assert store.stats()["by_version"]["1"] == {"put": 2, "taken": 0, "dropped_stale": 2, "refused_full": 1}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="max_lag"):
        SampleStore(capacity=4, max_lag=-1)
    with pytest.raises(ConfigError, match="capacity"):
        SampleStore(capacity=0, max_lag=0)
    store = SampleStore(capacity=4, max_lag=0)
    store.publish(3)
    with pytest.raises(ConfigError, match="versions only grow"):
        store.publish(2)
    with pytest.raises(ConfigError, match="at least one"):
        store.take(0, current=3)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_under_random_traffic_nothing_is_taken_beyond_k_and_every_group_is_accounted_for(k: int) -> None:
    rng = random.Random(k)
    store = SampleStore(capacity=16, max_lag=k)
    version, sent, refused, taken = 0, 0, 0, 0
    store.publish(0)
    for _ in range(5000):
        move = rng.random()
        if move < 0.6:  # a rollout finishes a group with the weights it has (up to 4 versions behind)
            outcome = store.put(max(0, version - rng.randint(0, 4)), None)
            sent += 1
            refused += outcome in (FULL, UNKNOWN)
        elif move < 0.9:
            for group in store.take(rng.randint(1, 4), current=version):
                assert group.version >= version - k, "trained beyond k"
                taken += 1
        else:
            version += 1
            store.publish(version)
    stats = store.stats()
    assert stats["taken"] == taken and stats["refused_full"] + stats["refused_unknown"] == refused
    assert stats["put"] == sent - refused == stats["taken"] + stats["dropped_stale"] + stats["held"]
