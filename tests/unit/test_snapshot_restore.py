"""SnapshotRestore alone, in real gloo groups of one rank and of two: which step it takes and what it loads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

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


class CopiesLost(BackgroundCopy):
    """The background copies of the listed takes (0-based) never run: the worker was killed before they landed."""

    def __init__(self, *lost: int) -> None:
        super().__init__()
        self.lost, self.started = set(lost), 0

    def start(self, copy: Callable[[], None], name: str, guard: Callable[[], None] | None = None) -> None:
        self.started += 1
        if self.started - 1 not in self.lost:
            super().start(copy, name, guard)


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
         asked: list[str] | None = None, rank: int = 0, peer_sets: list[tuple[int, ...]] | None = None,
         copies: BackgroundCopy | None = None) -> Rig:
    peer_sets = peer_sets or [(0,)]
    copies, logged = copies or BackgroundCopy(), []
    snapshots = RankSnapshots(SnapshotFile(path), rank=rank, capture=state.capture, stable=state.stable_storage,
                              copies=copies, fence=fence or AllowAll(), say=logged.append, fallback="-")

    def newest_persistent() -> int | None:
        if asked is not None:
            asked.append("newest persistent")
        return None

    world_size = sum(len(peers) for peers in peer_sets)
    restore = SnapshotRestore(snapshots, state, rank=rank, world_size=world_size, peer_sets=peer_sets, group=group,
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
    rig.copies.wait()


def test_a_snapshot_of_another_shape_is_not_used(tmp_path: Path, group: dist.ProcessGroup) -> None:
    _rig(tmp_path / "segment", _trained(width=8), group).take(0)
    rig = _rig(tmp_path / "segment", _trained(width=16), group)
    assert rig.restore.restore() is None
    [said] = rig.logged
    assert said.startswith("in-memory snapshot of step 0 does not fit this model (model.")
    assert said.endswith("; trying persistent checkpoints")


def test_a_partial_snapshot_alone_is_not_restored(tmp_path: Path, group: dist.ProcessGroup) -> None:
    rig = _rig(tmp_path / "segment", _trained(), group, copies=CopiesLost(0))
    rig.take(0)
    assert rig.snapshots.held() == ([], [0])
    assert rig.restore.restore() is None


def test_snapshots_turned_off_restore_nothing(tmp_path: Path, group: dist.ProcessGroup) -> None:
    rig = _rig(tmp_path / "segment", _trained(), group)
    rig.take(0)
    rig.snapshots.disable("test")
    assert rig.restore.restore() is None


def _two_ranks(rank: int, store: str, segments: str, results: str) -> None:
    """One rank of a two-rank world: a peer's step (rank 1's copy of step 1 never landed), then ranks
    apart (no step held by both)."""
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        group, said = dist.new_group(backend="gloo"), dict[str, object]()
        saved = _trained()
        copies = CopiesLost(1) if rank == 1 else BackgroundCopy()
        together, alone = [(0, 1)], [(0,), (1,)]
        writer = _rig(Path(segments) / f"peer{rank}", saved, group, copies=copies, rank=rank, peer_sets=together)
        writer.take(0)
        with torch.no_grad():
            for param in saved.model.parameters():
                param.add_(1.0)
        saved.extra["data"].manual_seed(100 + rank)  # this rank's data position of step 1
        writer.take(1)
        want_data = saved.extra["data"].get_state()
        fresh = _trained(steps=0)
        rig = _rig(Path(segments) / f"peer{rank}", fresh, group, rank=rank, peer_sets=together)
        restored = rig.restore.restore()
        rig.copies.wait()
        said["peer"] = restored.source if restored else None
        said["peer_model"] = all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(),
                                                                 saved.model.state_dict().values(), strict=True))
        said["peer_data"] = torch.equal(fresh.extra["data"].get_state(), want_data)
        writer = _rig(Path(segments) / f"apart{rank}", _trained(), group, rank=rank, peer_sets=alone)
        writer.take(2 - rank)  # rank 0 holds step 2, rank 1 step 1
        again = _rig(Path(segments) / f"apart{rank}", _trained(steps=0), group, rank=rank, peer_sets=alone)
        restored = again.restore.restore()
        again.copies.wait()
        said["apart"] = restored.step if restored else None
        said["apart_source"] = restored.source if restored else None
        said["apart_logged"] = again.logged
        (Path(results) / f"rank{rank}.json").write_text(json.dumps(said))
    finally:
        dist.destroy_process_group()


def test_two_ranks_take_a_peers_step_and_resume_apart(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    torch.multiprocessing.spawn(_two_ranks, args=(str(tmp_path / "store"), str(tmp_path), str(tmp_path / "results")),
                                nprocs=2)
    first, second = (json.loads((tmp_path / "results" / f"rank{r}.json").read_text()) for r in range(2))
    assert first["peer"] == "in-memory snapshot of step 1 (own)"
    assert second["peer"] == "in-memory snapshot of step 1 (rank 0's with its own data position)"
    assert first["peer_model"] and second["peer_model"] and first["peer_data"] and second["peer_data"]
    assert first["apart"] == second["apart"] == 2
    assert first["apart_source"] == "in-memory snapshot of step 2 (own; the job resumes after step 2)"
    assert second["apart_source"] == "in-memory snapshot of step 1 (own; the job resumes after step 2)"
    assert first["apart_logged"] == ["the ranks share no in-memory snapshot step: the job resumes at step 3, after "
                                     "the newest step any rank holds (rank 0 from step 2, rank 1 from step 1)"]
    assert second["apart_logged"] == []
