"""SnapshotRestore alone, in a real one-rank gloo group: which step it takes and what it loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from convoy.runtime.checkpoint_state import BackgroundCopy, Restored, TrainingState
from convoy.runtime.peers import SnapshotRestore
from convoy.runtime.slots import SnapshotFile
from convoy.runtime.snapshot import RankSnapshots


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dist.ProcessGroup]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


class AllowAll:
    def allows(self, what: str) -> bool:
        return True


class Refuse:
    """Allows a slot's commit, then refuses to mark it complete (the lease lapsed during the copy)."""

    def __init__(self) -> None:
        self.asked = 0

    def allows(self, what: str) -> bool:
        self.asked += 1
        return self.asked == 1


def _trained(width: int = 8, steps: int = 2) -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = TrainingState(model, optimizer, extra={"data": torch.Generator().manual_seed(5)})
    for _ in range(steps):
        loss = model(torch.randn(8, 4, generator=state.extra["data"])).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return state


@dataclass
class Rig:
    """One rank's snapshots and the restore that reads them, sharing one background copy."""

    snapshots: RankSnapshots
    restore: SnapshotRestore
    copies: BackgroundCopy
    logged: list[str]

    def take(self, step: int) -> None:
        self.snapshots.take(step)
        self.copies.wait()


def _rig(path: Path, state: TrainingState, group: dist.ProcessGroup, fence: object = None,
         asked: list[str] | None = None) -> Rig:
    copies, logged = BackgroundCopy(), []
    snapshots = RankSnapshots(SnapshotFile(path), rank=0, capture=state.capture, stable=state.stable_storage,
                              copies=copies, fence=fence or AllowAll(), say=logged.append, fallback="-")

    def newest_persistent() -> int | None:
        if asked is not None:
            asked.append("newest persistent")
        return None

    restore = SnapshotRestore(snapshots, state, rank=0, world_size=1, peer_sets=[(0,)], group=group,
                              peer_group=group, copies=copies, log=logged.append, newest_persistent=newest_persistent)
    return Rig(snapshots, restore, copies, logged)


def test_nothing_held_is_nothing_restored_and_rank_zero_asks_for_the_newest_persistent(
        tmp_path: Path, group: dist.ProcessGroup) -> None:
    asked: list[str] = []
    assert _rig(tmp_path / "segment", _trained(), group, asked=asked).restore.restore() is None
    assert asked == ["newest persistent"]


def test_own_snapshot_restores_model_optimizer_and_data_position(tmp_path: Path, group: dist.ProcessGroup) -> None:
    saved = _trained()
    _rig(tmp_path / "segment", saved, group).take(1)
    want_model = {k: v.clone() for k, v in saved.model.state_dict().items()}
    want_optim = [v.clone() for s in saved.optimizer.state.values() for v in s.values()]  # type: ignore[union-attr]
    want_data = saved.extra["data"].get_state()
    fresh = _trained(steps=0)
    rig = _rig(tmp_path / "segment", fresh, group)
    assert rig.restore.restore() == Restored(1, "in-memory snapshot of step 1")
    rig.copies.wait()  # the optimizer's state is filled in the background
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in want_model.items())
    got_optim = [v for s in fresh.optimizer.state.values() for v in s.values()]  # type: ignore[union-attr]
    assert len(got_optim) == len(want_optim) and all(map(torch.equal, got_optim, want_optim))
    assert torch.equal(fresh.extra["data"].get_state(), want_data)
    assert rig.logged == ["resumed from the in-memory snapshot of step 1"]


def test_the_newest_whole_step_wins(tmp_path: Path, group: dist.ProcessGroup) -> None:
    rig = _rig(tmp_path / "segment", _trained(), group)
    for step in (3, 4):
        rig.take(step)
    assert rig.restore.restore() == Restored(4, "in-memory snapshot of step 4")


def test_a_snapshot_of_another_shape_is_not_used(tmp_path: Path, group: dist.ProcessGroup) -> None:
    _rig(tmp_path / "segment", _trained(width=8), group).take(0)
    rig = _rig(tmp_path / "segment", _trained(width=16), group)
    assert rig.restore.restore() is None
    [said] = rig.logged
    assert said.startswith("in-memory snapshot of step 0 does not fit this model (model.")
    assert said.endswith("; trying persistent checkpoints")


def test_a_partial_snapshot_alone_is_not_restored(tmp_path: Path, group: dist.ProcessGroup) -> None:
    rig = _rig(tmp_path / "segment", _trained(), group, fence=Refuse())
    rig.take(0)
    assert rig.snapshots.held() == ([], [0])
    assert rig.restore.restore() is None


def test_snapshots_turned_off_restore_nothing(tmp_path: Path, group: dist.ProcessGroup) -> None:
    rig = _rig(tmp_path / "segment", _trained(), group)
    rig.take(0)
    rig.snapshots.disable("test")
    assert rig.restore.restore() is None
