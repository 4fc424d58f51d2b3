"""A parameter server's apply math against torch's own optimizers on the same gradients (dense tensors, and table
rows against a sparse gradient / SparseAdam), versions per push, the save/restore round trip, and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convoy.errors import CheckpointError, ConfigError
from convoy.parallel.ps.client import PSClient
from convoy.parallel.ps.optimizers import OptimizerSpec
from convoy.parallel.ps.placement import DenseSpec, TableSpec, place
from convoy.parallel.ps.server import ParameterServer, restore_shard, save_shard, shard_of

ROWS, DIM, SERVERS, STEPS = 23, 5, 2, 6
SPECS = {"sgd": OptimizerSpec("sgd", 0.1), "adagrad": OptimizerSpec("adagrad", 0.1),
         "adam": OptimizerSpec("adam", 0.01, eps=1e-8)}


def torch_optimizers(name: str, dense: torch.nn.Parameter, table: torch.nn.Parameter) -> list[torch.optim.Optimizer]:
    if name == "sgd":
        return [torch.optim.SGD([dense, table], lr=0.1)]
    if name == "adagrad":
        return [torch.optim.Adagrad([dense, table], lr=0.1)]
    return [torch.optim.Adam([dense], lr=0.01), torch.optim.SparseAdam([table], lr=0.01)]


def model() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return {"w": torch.randn(4, 3, generator=gen)}, {"emb": torch.randn(ROWS, DIM, generator=gen)}


def gradients(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense gradient, and row ids (repeats, some rows never) with one gradient row per id."""
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, ROWS - 4, (9,), generator=gen)  # the last 4 rows are never touched
    ids[1] = ids[0]
    return torch.randn(4, 3, generator=gen), ids, torch.randn(9, DIM, generator=gen)


def servers(optimizer: OptimizerSpec) -> list[ParameterServer]:
    dense, tables = model()
    placement = place([DenseSpec("w", (4, 3))], [TableSpec("emb", ROWS, DIM)], SERVERS)
    return [ParameterServer(index, placement, optimizer, *shard_of(placement, index, dense, tables))
            for index in range(SERVERS)]


def push_all(shards: list[ParameterServer], step: int, worker: str = "w0") -> None:
    dense_grad, ids, row_grads = gradients(step)
    placement = shards[0].placement
    owner = placement.owner_of_rows(ids)
    for shard in shards:
        mine = owner == shard.index
        dense = {name: dense_grad for name in shard.dense}
        shard.push(worker, dense, {"emb": (placement.local_rows(ids[mine]), row_grads[mine])})


def whole_table(shards: list[ParameterServer]) -> torch.Tensor:
    table = torch.empty(ROWS, DIM)
    for shard in shards:
        table[shard.index::SERVERS] = shard.rows["emb"]
    return table


@pytest.mark.parametrize("name", sorted(SPECS))
def test_server_updates_equal_torch_optimizers_on_the_same_gradients(name: str) -> None:
    shards = servers(SPECS[name])
    dense0, tables0 = model()
    dense = torch.nn.Parameter(dense0["w"].clone())
    table = torch.nn.Parameter(tables0["emb"].clone())
    optimizers = torch_optimizers(name, dense, table)
    for step in range(STEPS):
        dense_grad, ids, row_grads = gradients(step)
        dense.grad = dense_grad.clone()
        table.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), row_grads, (ROWS, DIM), check_invariants=True)
        for optimizer in optimizers:
            optimizer.step()
        push_all(shards, step)
        owner = next(shard for shard in shards if "w" in shard.dense)
        torch.testing.assert_close(owner.dense["w"], dense.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(whole_table(shards), table.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(whole_table(shards)[-4:], tables0["emb"][-4:])  # rows never pushed never move
    assert [shard.version for shard in shards] == [STEPS, STEPS]
    assert all(shard.applied == {"w0": STEPS} for shard in shards)


def test_only_pushed_rows_change_their_optimizer_state() -> None:
    shard = servers(SPECS["adam"])[0]
    before = shard.rows_state["emb"]["exp_avg"].clone()
    shard.push("w0", {}, {"emb": (torch.tensor([2, 2, 5]), torch.ones(3, DIM))})
    changed = (shard.rows_state["emb"]["exp_avg"] != before).any(1).nonzero().flatten().tolist()
    assert changed == [2, 5]
    assert shard.rows_state["emb"]["exp_avg_sq"][[0, 1, 3, 4]].abs().sum() == 0


@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_a_restored_server_continues_exactly(name: str, tmp_path: Path) -> None:
    shards = servers(SPECS[name])
    for step in range(3):
        push_all(shards, step, worker="w1")
    paths = [tmp_path / f"ps-{shard.index}.pt" for shard in shards]
    for shard, path in zip(shards, paths, strict=True):
        save_shard(shard, path)
    restored = [restore_shard(path) for path in paths]
    assert [shard.version for shard in restored] == [3, 3] and restored[0].applied == {"w1": 3}
    for step in range(3, 6):
        push_all(shards, step, worker="w1")
        push_all(restored, step, worker="w1")
    assert torch.equal(whole_table(restored), whole_table(shards))
    for mine, theirs in zip(shards, restored, strict=True):
        for tensor_name in mine.dense:
            assert torch.equal(mine.dense[tensor_name], theirs.dense[tensor_name])
        assert mine.rows_state["emb"]["step"] == theirs.rows_state["emb"]["step"] == 6
    with pytest.raises(CheckpointError, match="given the state of server 1"):
        shards[0].load_state_dict(shards[1].state_dict())
    with pytest.raises(CheckpointError, match="no parameter-server shard"):
        restore_shard(tmp_path / "missing.pt")


def test_bad_pushes_and_settings_are_refused_by_name() -> None:
    shard = next(s for s in servers(SPECS["sgd"]) if "w" in s.dense)
    before = shard.state_dict()
    with pytest.raises(ConfigError, match="holds no dense tensor 'nope'"):
        shard.push("w0", {"nope": torch.ones(2)}, {})
    with pytest.raises(ConfigError, match=r"gradient of 'w' has shape \[3, 4\].*holds \[4, 3\]"):
        shard.push("w0", {"w": torch.ones(3, 4)}, {})
    with pytest.raises(ConfigError, match="local row 99 of table 'emb' is not held here"):
        shard.push("w0", {}, {"emb": (torch.tensor([99]), torch.ones(1, DIM))})
    with pytest.raises(ConfigError, match=r"gradient rows of table 'emb' has shape \[2, 4\]"):
        shard.push("w0", {}, {"emb": (torch.tensor([0, 1]), torch.ones(2, 4))})
    with pytest.raises(ConfigError, match="holds no table 'other'"):
        shard.push("w0", {}, {"other": (torch.tensor([0]), torch.ones(1, DIM))})
    assert shard.version == 0 and torch.equal(shard.dense["w"], before["dense"]["w"])  # nothing half-applied
    with pytest.raises(ConfigError, match=r"optimizer 'rmsprop' is unknown; use one of \['sgd', 'adagrad', 'adam'\]"):
        OptimizerSpec("rmsprop", 0.1).validate()
    with pytest.raises(ConfigError, match="lr must be > 0"):
        OptimizerSpec("adam", 0.0).validate()
    with pytest.raises(ConfigError, match="betas must be two values"):
        OptimizerSpec("adam", 0.1, betas=(0.9, 1.0)).validate()
    with pytest.raises(ConfigError, match="staleness bound must be >= 0 \\(got -1\\)"):
        PSClient(shard.placement, ["127.0.0.1:1", "127.0.0.1:2"], "w0", staleness=-1)


def test_a_tag_is_applied_once_and_its_repeats_counted() -> None:
    """A batch trained again after its shard was given back reaches the server again: it is handled (the worker's
    count goes on) but not applied; the tags and the repeats survive a save."""
    tagged, plain = servers(SPECS["adagrad"]), servers(SPECS["adagrad"])
    for step in (0, 1, 1, 2, 0):
        dense_grad, ids, row_grads = gradients(step)
        owner = tagged[0].placement.owner_of_rows(ids)
        for shard in tagged:
            mine = owner == shard.index
            shard.push("w0", {n: dense_grad for n in shard.dense},
                       {"emb": (shard.placement.local_rows(ids[mine]), row_grads[mine])}, tag=step)
    for step in (0, 1, 2):
        push_all(plain, step)
    assert torch.equal(whole_table(tagged), whole_table(plain))
    assert [(s.version, s.applied, s.tags, s.duplicates) for s in tagged] == [(3, {"w0": 5}, {0, 1, 2}, 2)] * 2
    again = ParameterServer(0, tagged[0].placement, SPECS["adagrad"], *shard_of(tagged[0].placement, 0, *model()))
    again.load_state_dict(tagged[0].state_dict())
    assert (again.tags, again.duplicates, again.version) == ({0, 1, 2}, 2, 3)
    again.push("w0", {}, {"emb": (torch.tensor([0]), torch.ones(1, DIM))}, tag=1)
    assert (again.version, again.duplicates) == (3, 3)
