"""The replay buffer's storage: exact rows in and out, the ring's bounds in transitions and bytes, malformed
inserts refused whole, prioritized draws in proportion, stale priority updates dropped, and a saved form that
restores the same buffer."""

from __future__ import annotations

import pytest
import torch

from convoy.workloads.rl.buffer import BadTransitions, Layout, ReplayBuffer
from convoy.workloads.rl.sumtree import SumTree

LAYOUT = Layout.for_dqn((4,))


def transitions(first: int, count: int) -> dict[str, torch.Tensor]:
    """Rows whose every column encodes its number, so any row read back names itself."""
    ids = torch.arange(first, first + count)
    return {"obs": ids.float().unsqueeze(1).repeat(1, 4), "action": ids, "reward": ids.float(),
            "next_obs": (ids.float() + 0.5).unsqueeze(1).repeat(1, 4), "discount": torch.full((count,), 0.99)}


def test_rows_come_back_exactly_and_the_ring_keeps_the_newest() -> None:
    buffer = ReplayBuffer(LAYOUT, capacity=10)
    buffer.insert(transitions(0, 6), source="a")
    buffer.insert(transitions(6, 7), source="b")
    assert buffer.size == 10 and buffer.counters.inserted == 13 and buffer.counters.by_source == {"a": 6, "b": 7}
    sampled = buffer.sample(500)
    ids = sampled.batch["action"]
    assert set(ids.tolist()) == set(range(3, 13))  # the oldest three were overwritten
    assert torch.equal(sampled.batch["reward"], ids.float())
    assert torch.equal(sampled.batch["obs"][:, 2], ids.float()) and torch.equal(sampled.written, ids)
    buffer.insert(transitions(13, 25), source="a")  # larger than the ring, starting mid-ring: its newest 10 stay
    sampled = buffer.sample(500)
    assert set(sampled.batch["action"].tolist()) == set(range(28, 38))
    assert torch.equal(sampled.written, sampled.batch["action"]) and torch.equal(buffer.written.sort().values,
                                                                                 torch.arange(28, 38))


def test_frames_are_kept_as_uint8_and_come_back_exactly() -> None:
    buffer = ReplayBuffer(Layout.for_dqn((4, 84, 84), torch.uint8), capacity=50)
    frames = torch.randint(0, 256, (61, 4, 84, 84), dtype=torch.uint8)
    for first in range(0, 60, 20):
        buffer.insert({"obs": frames[first:first + 20], "action": torch.arange(first, first + 20),
                       "reward": torch.zeros(20), "next_obs": frames[first + 1:first + 21],
                       "discount": torch.ones(20)})
    sampled = buffer.sample(200)
    assert sampled.batch["obs"].dtype == torch.uint8
    assert torch.equal(sampled.batch["obs"], frames[sampled.batch["action"]])
    assert torch.equal(sampled.batch["next_obs"], frames[sampled.batch["action"] + 1])


def test_capacity_in_bytes_bounds_the_rows() -> None:
    row = LAYOUT.row_bytes
    assert row == 4 * 4 + 8 + 4 + 4 * 4 + 4
    assert ReplayBuffer(LAYOUT, capacity=1000, max_bytes=row * 7 + 3).capacity == 7


@pytest.mark.parametrize(("change", "error"), [
    (lambda b: b.pop("discount"), r"missing \['discount'\]"),
    (lambda b: b.update(extra=torch.zeros(2)), r"unknown \['extra'\]"),
    (lambda b: b.update(action=b["action"].float()), "column 'action' must be torch.int64"),
    (lambda b: b.update(obs=torch.zeros(2, 3)), r"column 'obs' must be torch.float32 of shape \[n, \[4\]\]"),
    (lambda b: b.update(reward=torch.zeros(3)), "has 3 rows where the others have 2"),
    (lambda b: b.update(reward=torch.tensor([1.0, float("nan")])), "NaN or infinite"),
])
def test_a_malformed_insert_is_refused_whole_and_counted(change, error: str) -> None:  # type: ignore[no-untyped-def]
    buffer = ReplayBuffer(LAYOUT, capacity=10)
    buffer.insert(transitions(0, 3))
    bad = transitions(3, 2)
    change(bad)
    with pytest.raises(BadTransitions, match=error):
        buffer.insert(bad)
    assert buffer.size == 3 and buffer.counters.inserted == 3 and buffer.counters.refused == 1
    assert set(buffer.sample(100).batch["action"].tolist()) == {0, 1, 2}


def test_the_sum_tree_draws_in_proportion_to_priorities() -> None:
    tree = SumTree(5)
    tree.set(torch.arange(5), torch.tensor([0.0, 1.0, 2.0, 0.0, 7.0]))
    assert tree.total == 10.0
    draws = tree.draw(20000, torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=5).double() / 20000
    assert counts[0] == 0 and counts[3] == 0
    assert torch.allclose(counts, torch.tensor([0.0, 0.1, 0.2, 0.0, 0.7], dtype=torch.float64), atol=0.01)


def test_prioritized_sampling_weights_and_stale_updates() -> None:
    buffer = ReplayBuffer(LAYOUT, capacity=4, alpha=1.0, beta=1.0)
    buffer.insert(transitions(0, 4))
    sampled = buffer.sample(4)
    applied = buffer.update_priorities(torch.arange(4), buffer.written[:4].clone(), torch.tensor([0.0, 0.0, 0.0, 9.0]))
    assert applied == 4
    draws = buffer.sample(200)
    assert (draws.batch["action"] == 3).float().mean() > 0.99
    assert float(draws.weights.max()) == 1.0
    buffer.insert(transitions(4, 1))  # rewrites slot 0
    stale = buffer.update_priorities(torch.tensor([0]), torch.tensor([0]), torch.tensor([5.0]))
    assert stale == 0 and buffer.counters.stale_priorities == 1
    assert sampled.weights.shape == (4,)


def test_the_saved_form_restores_the_same_buffer() -> None:
    buffer = ReplayBuffer(LAYOUT, capacity=8, alpha=0.6)
    buffer.insert(transitions(0, 11), source="a")
    buffer.update_priorities(torch.tensor([1, 2]), buffer.written[torch.tensor([1, 2])], torch.tensor([3.0, 0.5]))
    again = ReplayBuffer.from_saved(buffer.saved_form())
    for name in buffer.columns:
        assert torch.equal(again.columns[name], buffer.columns[name])
    assert torch.equal(again.written, buffer.written) and again.size == buffer.size == 8
    assert torch.allclose(again.tree.get(torch.arange(8)), buffer.tree.get(torch.arange(8)))  # type: ignore[union-attr]
    assert again.counters.inserted == 11 and again.counters.by_source == {"a": 11}
    again.insert(transitions(11, 1))
    assert int(again.written[11 % 8]) == 11
