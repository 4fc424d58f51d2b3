"""RankSnapshots alone: taking this rank's snapshots into a real slot file, without a process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convoy.errors import CheckpointError
from convoy.runtime.checkpoint_state import BackgroundCopy
from convoy.runtime.slots import HEADER_SIZE, SnapshotFile
from convoy.runtime.snapshot import RankSnapshots
from convoy.worker import events as worker_events


class ScriptedFence:
    """Answers each ask in turn from ``answers`` (then allows); an exception in the list is raised."""

    def __init__(self, *answers: bool | Exception) -> None:
        self.answers, self.asked = list(answers), []

    def allows(self, what: str) -> bool:
        self.asked.append(what)
        answer = self.answers.pop(0) if self.answers else True
        if isinstance(answer, Exception):
            raise answer
        return answer


class Weights:
    """A live state: ``weight`` stands for parameters (copied in the background), ``buffer`` for the rest."""

    def __init__(self, size: int = 64) -> None:
        self.weight, self.buffer, self.position = torch.arange(size, dtype=torch.float32), torch.ones(3), 0

    def capture(self, step: int) -> dict[str, object]:
        return {"step": step, "model": {"weight": self.weight, "buffer": self.buffer}, "position": self.position}

    def stable(self) -> set[int]:
        return {self.weight.data_ptr()}


def _snapshots(path: Path, live: Weights, fence: ScriptedFence | None = None, said: list[str] | None = None,
               copies: BackgroundCopy | None = None, background: bool = True) -> RankSnapshots:
    return RankSnapshots(SnapshotFile(path), rank=3, capture=live.capture, stable=live.stable,
                         copies=copies or BackgroundCopy(), fence=fence or ScriptedFence(),
                         say=(said if said is not None else []).append, fallback="what goes on", background=background)


def test_a_snapshot_lands_whole_after_its_background_copy(tmp_path: Path) -> None:
    live, copies, fence = Weights(), BackgroundCopy(), ScriptedFence()
    snapshots = _snapshots(tmp_path / "segment", live, fence, copies=copies)
    snapshots.take(0)
    copies.wait()
    assert snapshots.held() == ([0], [0]) and fence.asked == ["snapshot of step 0"], "asked once, before the commit"
    live.weight.add_(1.0)
    live.position = 1
    snapshots.take(1)
    copies.wait()
    assert snapshots.held() == ([1, 0], [1, 0])
    old, new = snapshots.read(0), snapshots.read(1)
    assert torch.equal(old["model"]["weight"], live.weight - 1.0) and old["position"] == 0
    assert torch.equal(new["model"]["weight"], live.weight) and new["position"] == 1


def test_without_background_copies_the_slot_is_complete_at_once(tmp_path: Path) -> None:
    live, copies = Weights(), BackgroundCopy()
    snapshots = _snapshots(tmp_path / "segment", live, copies=copies, background=False)
    snapshots.take(4)
    assert snapshots.held() == ([4], [4])  # before any wait: nothing was left to a background copy


def test_a_refused_commit_writes_nothing(tmp_path: Path) -> None:
    live = Weights()
    snapshots = _snapshots(tmp_path / "segment", live, ScriptedFence(False))
    snapshots.take(0)
    assert snapshots.held() == ([], [])


def test_a_lease_lost_during_the_copy_still_completes_the_step_the_round_committed(tmp_path: Path) -> None:
    live, copies = Weights(), BackgroundCopy()
    fence = ScriptedFence(True, False)
    snapshots = _snapshots(tmp_path / "segment", live, fence, copies=copies)
    snapshots.take(2)  # committed partial under the lease; the lease lapses while the copy runs
    copies.wait()
    assert snapshots.held() == ([2], [2]) and fence.asked == ["snapshot of step 2"]
    snapshots.take(3)  # the next step is refused: it was not committed before the round ended
    copies.wait()
    assert snapshots.held() == ([2], [2])


def test_a_copy_killed_before_it_landed_leaves_the_slot_partial(tmp_path: Path) -> None:
    live = Weights()

    class Killed(BackgroundCopy):
        def start(self, copy: object, name: str, guard: object = None) -> None:
            pass  # the worker died before the copy ran

    snapshots = _snapshots(tmp_path / "segment", live, copies=Killed())
    snapshots.take(2)
    assert snapshots.held() == ([], [2]) and snapshots.has_partial(2)
    part = snapshots.read(2, partial=True)
    assert part["model"]["weight"] is None and torch.equal(part["model"]["buffer"], live.buffer)


def test_an_error_in_the_background_copy_is_raised_at_the_next_wait(tmp_path: Path) -> None:
    copies = BackgroundCopy()

    def fails() -> None:
        raise OSError(28, "No space left on device")

    copies.start(fails, "test-copy")
    with pytest.raises(CheckpointError, match="in-memory snapshot failed: .*No space left on device"):
        copies.wait()
    copies.wait()  # raised once, not again


def test_a_larger_state_grows_the_slots(tmp_path: Path) -> None:
    live, copies = Weights(size=16), BackgroundCopy()
    snapshots = _snapshots(tmp_path / "segment", live, copies=copies)
    snapshots.take(0)
    copies.wait()
    first = snapshots.file.slot_size  # type: ignore[union-attr]
    live.weight = torch.zeros(first)  # four bytes an element: no longer fits
    snapshots.take(1)
    copies.wait()
    assert snapshots.file.slot_size > first and snapshots.held()[0] == [1]  # type: ignore[union-attr]


def test_no_room_for_the_model_turns_snapshots_off_once_with_the_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    live, said, copies = Weights(), [], BackgroundCopy()
    snapshots = _snapshots(tmp_path / "segment", live, said=said, copies=copies)
    snapshots.take(0)
    copies.wait()  # as the Checkpointer does before it touches the segment again
    assert (tmp_path / "segment").exists()
    snapshots.check_space(1 << 60)
    assert not snapshots.enabled and not (tmp_path / "segment").exists()
    assert len(said) == 1 and said[0].startswith("in-memory snapshots turned off on rank 3: two snapshots")
    assert said[0].endswith("; what goes on")
    events = [event for line in capsys.readouterr().err.splitlines() if (event := worker_events.parse(line))]
    assert events == [("snapshot_disabled", said[0])]
    snapshots.take(1)  # training goes on without them
    assert snapshots.held() == ([], [])


def test_enough_room_keeps_snapshots_on(tmp_path: Path) -> None:
    snapshots = _snapshots(tmp_path / "segment", Weights())
    snapshots.check_space(1024)
    assert snapshots.enabled


def test_a_reopened_segment_goes_on_from_its_sequence(tmp_path: Path) -> None:
    live, copies = Weights(), BackgroundCopy()
    first = _snapshots(tmp_path / "segment", live, copies=copies)
    for step in range(3):
        first.take(step)
        copies.wait()
    first.file.close()  # type: ignore[union-attr]
    again = _snapshots(tmp_path / "segment", live, copies=copies)
    assert again.held() == ([2, 1], [2, 1])
    again.take(3)  # overwrites the older slot (step 1), not the newest
    copies.wait()
    assert again.held() == ([3, 2], [3, 2])


def test_unreadable_slots_are_said_by_their_rank(tmp_path: Path) -> None:
    live, copies, said = Weights(), BackgroundCopy(), []
    snapshots = _snapshots(tmp_path / "segment", live, said=said, copies=copies)
    for step in range(2):
        snapshots.take(step)
        copies.wait()
    file = snapshots.file
    assert file is not None
    index = next(i for i, slot in enumerate(file.slots()) if slot[1] == 1)
    _, _, data_len, meta_len, _ = file.slots()[index]
    with open(file.path, "r+b") as handle:
        handle.seek(HEADER_SIZE + index * file.slot_size + data_len)
        handle.write(b"\x07" * meta_len)
    assert snapshots.held() == ([0], [0])
    assert len(said) == 1 and said[0].startswith("rank 3: ignoring unreadable in-memory snapshots: slot")
