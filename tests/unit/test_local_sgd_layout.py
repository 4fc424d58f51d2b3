"""Group-wise local SGD, the pure parts: the n x m layout, sync timing, byte accounting, the
outer Nesterov step, and the errors for bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from convoy.errors import CheckpointError, ConfigError
from convoy.parallel.local_sgd import Layout, Nesterov, check_every, outer_from_name, outer_step, shard_model
from convoy.runtime.checkpoint_state import peer_sets


def test_groups_of_a_2x3_layout() -> None:
    layout = Layout(2, 3)
    assert layout.world_size == 6
    assert layout.model_groups() == ((0, 1, 2), (3, 4, 5))
    assert layout.shard_groups() == ((0, 3), (1, 4), (2, 5))
    assert [layout.group_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [layout.shard_of(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert layout.rank(1, 2) == 5


def test_every_rank_is_in_one_model_group_and_one_shard_group() -> None:
    for n, m in ((1, 1), (1, 4), (4, 1), (3, 2), (2, 5)):
        layout = Layout(n, m)
        for sets in (layout.model_groups(), layout.shard_groups()):
            assert sorted(r for s in sets for r in s) == list(range(n * m))
        for rank in range(n * m):
            shard_group = layout.shard_groups()[layout.shard_of(rank)]
            model_group = layout.model_groups()[layout.group_of(rank)]
            assert set(shard_group) & set(model_group) == {rank}


def test_layout_from_world_and_env() -> None:
    assert Layout.from_world(8, 2) == Layout(4, 2)
    assert Layout.from_env(4, {"WORLD_SIZE": "8"}) == Layout(2, 4)
    with pytest.raises(ConfigError, match=r"world size 6 is not n groups x 4 shards.*multiple of 4"):
        Layout.from_world(6, 4)
    with pytest.raises(ConfigError, match="shards >= 1"):
        Layout.from_world(4, 0)
    with pytest.raises(ConfigError, match="WORLD_SIZE is not set"):
        Layout.from_env(2, {})
    with pytest.raises(ConfigError, match="n_groups >= 1"):
        Layout(0, 2)
    with pytest.raises(ConfigError, match="outside a 2 x 2 layout"):
        Layout(2, 2).group_of(4)


def test_sync_times_plain_and_staggered() -> None:
    layout = Layout(2, 2)
    plain = [s for s in range(24) if layout.due(s, 1, 8)]
    assert plain == [7, 15, 23] == [s for s in range(24) if layout.due(s, 0, 8)]
    assert [s for s in range(24) if layout.due(s, 0, 8, stagger=True)] == [7, 15, 23]
    assert [s for s in range(24) if layout.due(s, 1, 8, stagger=True)] == [3, 11, 19]
    four = Layout(1, 4)
    firsts = [next(s for s in range(8) if four.due(s, k, 8, stagger=True)) for k in range(4)]
    assert firsts == [7, 1, 3, 5]  # one shard every two steps
    assert all(layout.due(s, 0, 1) for s in range(5))  # every=1: each step


def test_every_must_be_at_least_one() -> None:
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ConfigError, match="every >= 1"):
            check_every(bad)  # type: ignore[arg-type]


def test_cross_group_bytes_of_a_ring_allreduce() -> None:
    assert Layout(2, 2).cross_bytes(1000) == 1000
    assert Layout(4, 2).cross_bytes(1000) == 1500
    assert Layout(1, 2).cross_bytes(1000) == 0


def test_outer_step_is_torch_sgd_with_nesterov() -> None:
    torch.manual_seed(0)
    outer = Nesterov(lr=0.7, momentum=0.9)
    anchor, buffer = torch.randn(10), torch.zeros(10)
    reference = nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(4):
        average = anchor + 0.1 * torch.randn(10)
        reference.grad = reference.detach() - average
        sgd.step()
        outer_step(anchor, average, buffer, outer)
        torch.testing.assert_close(anchor, reference.detach(), rtol=0, atol=1e-6)


def test_outer_choices() -> None:
    assert outer_from_name("average") == "average"
    assert outer_from_name("nesterov", 0.5, 0.8) == Nesterov(0.5, 0.8)
    with pytest.raises(ConfigError, match="unknown outer optimizer 'adam'"):
        outer_from_name("adam")
    with pytest.raises(ConfigError, match="lr > 0"):
        Nesterov(lr=0)
    with pytest.raises(ConfigError, match="momentum < 1"):
        Nesterov(momentum=1.0)


def test_layer_wise_sharding_and_a_model_too_small_to_split() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    pieces = [shard_model(model, Layout(1, 2), k) for k in range(2)]
    assert [len(p) for p in pieces] == [2, 1]
    assert pieces[0][0] is model[0]
    with pytest.raises(ConfigError, match="cannot split the model into 4 shards: 4 stages but the model has 3 layers"):
        shard_model(model, Layout(1, 4), 0)


def test_checkpointer_peer_sets() -> None:
    assert peer_sets(True, 3) == [(0, 1, 2)]
    assert peer_sets(False, 2) == [(0,), (1,)]
    assert peer_sets(Layout(2, 2).shard_groups(), 4) == [(0, 2), (1, 3)]
    with pytest.raises(CheckpointError, match="every rank 0..3 in exactly one"):
        peer_sets([(0, 1), (1, 2)], 4)
