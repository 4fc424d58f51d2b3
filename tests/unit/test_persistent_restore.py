"""PersistentSaver and PersistentRestore alone, in a real one-rank gloo group: DCP save, then restore."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from convoy.errors import CheckpointError
from convoy.runtime.checkpoint_state import Restored, TrainingState
from convoy.runtime.persist import (
    PersistentRestore, PersistentSaver, complete_checkpoints, dcp_state, prune_to_saved, saved_ranks,
)


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dist.ProcessGroup]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


class Counter:
    """A stateful object that belongs with the model (as an outer optimizer would)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = int(state["value"])


def _state(width: int = 8, seed: int = 0, counter: int = 0) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    return TrainingState(model, optimizer, extra={"data": torch.Generator().manual_seed(seed)},
                         shared={"outer": Counter(counter)})


def _save(root: Path, state: TrainingState, group: dist.ProcessGroup, steps: list[int], rank: int = 0,
          keep: int = 2) -> list[str]:
    logged: list[str] = []
    saver = PersistentSaver(root, group, 0, keep, 0, logged.append)
    for step in steps:
        saver.save_async(dcp_state(state, step, rank), step, state.stable_storage())
        saver.wait()
    return logged


def _restore(root: Path, state: TrainingState, group: dist.ProcessGroup,
             peers: tuple[int, ...] = (0,)) -> tuple[PersistentRestore, list[str]]:
    logged: list[str] = []
    return PersistentRestore(root, state, rank=0, world_size=1, peers=peers, group=group, log=logged.append), logged


def test_nothing_saved_is_nothing_restored(tmp_path: Path, group: dist.ProcessGroup) -> None:
    restore, logged = _restore(tmp_path, _state(), group)
    assert restore.newest() is None and restore.restore() is None and logged == []


def test_a_save_restores_model_optimizer_and_this_ranks_part(tmp_path: Path, group: dist.ProcessGroup) -> None:
    saved = _state(seed=1, counter=7)
    saved.extra["data"].manual_seed(42)
    assert _save(tmp_path, saved, group, [3]) == []
    fresh = _state(seed=2)
    restore, logged = _restore(tmp_path, fresh, group)
    assert restore.newest() == 3
    path = complete_checkpoints(tmp_path)[0][1]
    assert restore.restore() == Restored(3, f"persistent checkpoint {path}")
    assert logged == [f"resumed from persistent checkpoint {path} (step 3)"]
    for got, want in zip(fresh.model.state_dict().values(), saved.model.state_dict().values(), strict=True):
        assert torch.equal(got, want)
    momentum = [s["momentum_buffer"] for s in fresh.optimizer.state.values()]  # type: ignore[union-attr]
    want = [s["momentum_buffer"] for s in saved.optimizer.state.values()]  # type: ignore[union-attr]
    assert all(map(torch.equal, momentum, want))
    assert fresh.shared["outer"].value == 7
    assert torch.equal(fresh.extra["data"].get_state(), saved.extra["data"].get_state())


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_one_before(tmp_path: Path, group: dist.ProcessGroup) -> None:
    _save(tmp_path, _state(), group, [1, 3])
    newest = complete_checkpoints(tmp_path)[0][1]
    data_file = next(f for f in newest.iterdir() if f.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    restore, logged = _restore(tmp_path, _state(), group)
    restored = restore.restore()
    assert restored is not None and restored.step == 1
    assert logged[0].startswith(f"skipping checkpoint {newest}: ") and "checksum" in logged[0]


def test_a_checkpoint_of_another_shape_is_a_clear_error(tmp_path: Path, group: dist.ProcessGroup) -> None:
    _save(tmp_path, _state(width=8), group, [1])
    restore, logged = _restore(tmp_path, _state(width=16), group)
    with pytest.raises(CheckpointError, match="fits this model"):
        restore.restore()
    assert "cannot be loaded into this model" in logged[0]


def test_a_rank_the_checkpoint_lacks_keeps_its_own_part_and_takes_model_state_from_a_saved_peer(
        tmp_path: Path, group: dist.ProcessGroup) -> None:
    """As rank 0 of a new world whose peer, rank 1 of the saved world, left its part."""
    saved = _state(seed=1, counter=5)
    _save(tmp_path, saved, group, [2], rank=1)
    fresh = _state(seed=2)
    data_before = fresh.extra["data"].get_state()
    restore, logged = _restore(tmp_path, fresh, group, peers=(0, 1))
    assert restore.restore() is not None
    assert fresh.shared["outer"].value == 5 and torch.equal(fresh.extra["data"].get_state(), data_before)
    assert logged[0].endswith("(step 2); saved by ranks [1], restored on 1; ranks [0] have no saved data position "
                              "or RNG and keep their fresh ones (model_state from the lowest saved rank of their "
                              "peers); the data position and RNG saved by ranks [1] are not used")


def test_without_a_saved_peer_model_state_stays_fresh(tmp_path: Path, group: dist.ProcessGroup) -> None:
    _save(tmp_path, _state(counter=5), group, [2], rank=1)
    fresh = _state()
    restore, _ = _restore(tmp_path, fresh, group, peers=(0,))
    assert restore.restore() is not None and fresh.shared["outer"].value == 0


def test_saved_ranks_and_the_parts_a_checkpoint_holds() -> None:
    keys = ["rank0.extra.data", "rank0.rng.torch", "rank2.shared.outer.value", "ranking.x"]
    assert saved_ranks(keys) == [0, 2]
    live = {"extra": {"data": 1}, "shared": {"outer": {"value": 3}}, "rng": {"torch": 4, "numpy": 5}}
    assert prune_to_saved(live, "rank0", set(keys)) == {"extra": {"data": 1}, "rng": {"torch": 4}}
    assert prune_to_saved(live, "rank2", set(keys)) == {"shared": {"outer": {"value": 3}}}
    assert prune_to_saved(live, "rank1", set(keys)) is None
