"""Checkpointer in one process (world size 1): exact restore, fallbacks, and bad checkpoints."""

from __future__ import annotations

import os
import random
import subprocess
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy
import pytest
import torch
import torch.distributed as dist

import convoy
from convoy.errors import CheckpointError
from convoy.runtime import snapshot_budget
from convoy.runtime.persist import complete_checkpoints
from convoy.runtime.slots import HEADER_SIZE, SnapshotFile, free_bytes
from convoy.runtime.snapshot import SLACK
from convoy.shm import SHM_DIR, remove_segments
from convoy.worker import events as worker_events
from convoy.worker.lease import LeaseWriter


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> Iterator[None]:
    saved = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    convoy.init()
    yield
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    job_id = f"unit{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("CONVOY_JOB_ID", job_id)
    monkeypatch.setenv("CONVOY_RUN_DIR", str(tmp_path))
    yield job_id
    remove_segments(job_id)


class Trainer:
    """A tiny model, Adam, a data generator, and one training step that uses every RNG."""

    def __init__(self, width: int = 8) -> None:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(4, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 1)]
        self.model = torch.nn.Sequential(*layers)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.data = torch.Generator().manual_seed(5)

    def checkpointer(self, **kwargs: object) -> convoy.Checkpointer:
        return convoy.Checkpointer(self.model, self.optimizer, state={"data": self.data}, **kwargs)  # type: ignore[arg-type]

    def train_step(self) -> None:
        noise = torch.rand(1).item() + random.random() + float(numpy.random.rand())
        inputs = torch.randn(16, 4, generator=self.data) + noise
        loss = self.model(inputs).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def run(self, ckpt: convoy.Checkpointer, start: int, stop: int, close: bool = True) -> None:
        for step in range(start, stop):
            self.train_step()
            ckpt.step(step)
        if close:
            ckpt.close()

    def params(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in self.model.state_dict().values()]


def _seed() -> None:
    random.seed(1)
    numpy.random.seed(1)
    torch.manual_seed(1)


def _reference(steps: int) -> list[torch.Tensor]:
    trainer = Trainer()
    _seed()
    for _ in range(steps):
        trainer.train_step()
    return trainer.params()


def _seed_and_run(trainer: Trainer, ckpt: convoy.Checkpointer, steps: int) -> None:
    _seed()
    trainer.run(ckpt, 0, steps)


def test_fresh_start_is_step_zero(job: str) -> None:
    assert Trainer().checkpointer().restore() == 0


def _gloo_threads() -> int:
    """Threads of this process that belong to gloo groups (each group has its own worker loops)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append((Path("/proc/self/task") / task / "comm").read_text())
        except FileNotFoundError:  # a thread that ended since the listing
            pass
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)


def _threads_back_to(count: int, within_s: float = 5.0) -> int:
    """The gloo threads once they are ``count`` again, or after ``within_s``: a destroyed group's threads end on
    their own once told (on a loaded machine, a moment after ``destroy_process_group`` returns); left running they
    would be alive at the interpreter's exit, which is what close() must prevent."""
    deadline = time.monotonic() + within_s
    while _gloo_threads() > count and time.monotonic() < deadline:
        time.sleep(0.05)
    return _gloo_threads()


def test_close_joins_the_groups_threads_and_refuses_later_use(job: str, tmp_path: Path) -> None:
    """close() destroys the checkpoint's gloo groups while the interpreter runs: left to its exit, a gloo
    thread releasing a restore's all-gather tensors aborted the process (SIGABRT) after training finished."""
    trainer = Trainer()
    before = _gloo_threads()
    ckpt = trainer.checkpointer(persist_every=1, directory=tmp_path / "ckpt")
    trainer.run(ckpt, ckpt.restore(), 2, close=False)
    assert _gloo_threads() > before
    ckpt.close()
    assert _threads_back_to(before) == before, "close() left gloo threads running"
    ckpt.close()  # a second close is harmless
    with pytest.raises(CheckpointError, match=r"step\(\) after close\(\)"):
        ckpt.step(2)
    with pytest.raises(CheckpointError, match=r"restore\(\) after close\(\)"):
        ckpt.restore()


def test_resume_from_memory_is_bit_identical(job: str) -> None:
    first = Trainer()
    _seed_and_run(first, first.checkpointer(), 6)  # "killed" after step 5 finished
    random.seed(99)  # a new process would have other RNG states; restore must replace them
    torch.manual_seed(99)
    second = Trainer()
    ckpt = second.checkpointer()
    start = ckpt.restore()
    assert start == 6 and "in-memory snapshot of step 5" in ckpt.restored_from
    second.run(ckpt, start, 10)
    for got, want in zip(second.params(), _reference(10), strict=True):
        assert torch.equal(got, want)


def test_resume_from_persistent_checkpoint_when_memory_is_gone(job: str, tmp_path: Path) -> None:
    first = Trainer()
    _seed_and_run(first, first.checkpointer(persist_every=4), 6)  # saves after steps 3 (and would at 7)
    remove_segments(job)  # e.g. the node was replaced
    second = Trainer()
    ckpt = second.checkpointer()
    assert ckpt.restore() == 4 and "persistent checkpoint" in ckpt.restored_from
    second.run(ckpt, 4, 10)
    for got, want in zip(second.params(), _reference(10), strict=True):
        assert torch.equal(got, want)


def test_corrupt_checkpoint_is_skipped_with_a_message(job: str, tmp_path: Path) -> None:
    first = Trainer()
    _seed_and_run(first, first.checkpointer(persist_every=2, keep=3), 6)
    remove_segments(job)
    steps = [step for step, _ in complete_checkpoints(tmp_path / "checkpoints")]
    assert steps == [5, 3, 1]
    newest = complete_checkpoints(tmp_path / "checkpoints")[0][1]
    data_file = next(f for f in newest.iterdir() if f.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    messages: list[str] = []
    ckpt = Trainer().checkpointer(log=messages.append)
    assert ckpt.restore() == 4
    assert any("skipping" in m and "checksum" in m for m in messages), messages


def test_snapshot_of_another_model_shape_is_not_used(job: str) -> None:
    small = Trainer(width=8)
    small.run(small.checkpointer(), 0, 3)
    messages: list[str] = []
    ckpt = Trainer(width=16).checkpointer(log=messages.append)
    assert ckpt.restore() == 0
    assert any("does not fit this model" in m for m in messages), messages


def test_persistent_checkpoint_of_another_shape_is_a_clear_error(job: str) -> None:
    small = Trainer(width=8)
    small.run(small.checkpointer(persist_every=2), 0, 2)
    remove_segments(job)
    with pytest.raises(CheckpointError, match="fits this model"):
        Trainer(width=16).checkpointer().restore()


def test_unwritable_checkpoint_dir_reports_and_training_continues(job: str, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    messages: list[str] = []
    trainer = Trainer()
    ckpt = trainer.checkpointer(persist_every=2, directory=blocker / "ckpt", log=messages.append)
    trainer.run(ckpt, 0, 4)
    assert any("persistent save of step 1 failed" in m for m in messages), messages
    assert list(SHM_DIR.glob(f"convoy-{job}-*"))  # in-memory snapshots went on


def test_full_checkpoint_dir_reports_and_leaves_nothing_complete(job: str, tmp_path: Path) -> None:
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        messages: list[str] = []
        trainer = Trainer(width=512)  # its state does not fit in 64 KiB
        ckpt = trainer.checkpointer(persist_every=2, directory=mount, log=messages.append)
        trainer.run(ckpt, 0, 2)
        assert any("persistent save of step 1 failed" in m for m in messages), messages
        assert complete_checkpoints(mount) == [] and not list(mount.iterdir())
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(CheckpointError, match="every"):
        Trainer().checkpointer(every=0)


class IndexSampler:
    """A sampler that keeps its whole index order in its state: a skeleton of about 2.5 MB."""

    def __init__(self, size: int = 500_000) -> None:
        self.order, self.position = list(range(size)), 0

    def state_dict(self) -> dict[str, object]:
        return {"order": list(self.order), "position": self.position}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.order, self.position = list(state["order"]), int(state["position"])  # type: ignore[call-overload]


def test_state_far_larger_than_a_slot_reserve_snapshots_and_restores(job: str) -> None:
    trainer, sampler = Trainer(), IndexSampler()
    sampler.order.reverse()
    ckpt = convoy.Checkpointer(trainer.model, trainer.optimizer, state={"data": trainer.data, "sampler": sampler})
    for step in range(4):
        trainer.train_step()
        sampler.position = step
        ckpt.step(step)
    ckpt.close()
    second, fresh = Trainer(), IndexSampler(size=0)
    restored = convoy.Checkpointer(second.model, second.optimizer, state={"data": second.data, "sampler": fresh})
    assert restored.restore() == 4 and "in-memory snapshot of step 3" in restored.restored_from
    assert fresh.position == 3 and fresh.order == sampler.order


def test_refused_step_leaves_the_previous_snapshot_the_newest(job: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    lease = LeaseWriter(tmp_path / "lease")
    monkeypatch.setenv("CONVOY_LEASE", str(lease.path))
    monkeypatch.setenv("CONVOY_ROUND", "3")
    lease.grant(3, time.monotonic(), 60.0)
    messages: list[str] = []
    trainer = Trainer()
    ckpt = trainer.checkpointer(persist_every=2, log=messages.append)
    trainer.run(ckpt, 0, 2, close=False)  # snapshots of steps 0, 1 and a persistent checkpoint of step 1
    ckpt.wait()
    lease.revoke()  # the agent learnt that round 3 ended
    trainer.run(ckpt, 2, 4)  # would snapshot 2, 3 and persist 3
    lease.close()
    assert [step for step, _ in complete_checkpoints(tmp_path / "checkpoints")] == [1]
    assert messages == ["round 3 is no longer current: snapshot of step 2 not committed; "
                        "the agent will stop this worker"]
    monkeypatch.delenv("CONVOY_LEASE")
    again = Trainer().checkpointer()
    assert again.restore() == 2 and "in-memory snapshot of step 1" in again.restored_from


@pytest.mark.parametrize("when", ["at construction", "on growth"])
def test_full_shared_memory_turns_snapshots_off_once_and_training_goes_on(
        job: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        when: str) -> None:
    mount = tmp_path / "shm"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        monkeypatch.setattr("convoy.shm.SHM_DIR", mount)
        trainer = Trainer(width=1024)
        model_bytes = sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())
        first_check = HEADER_SIZE + 2 * (model_bytes + SLACK)  # the model alone, twice: Adam's state comes later
        room = first_check - 16384 if when == "at construction" else first_check + 16384
        (mount / "filler").write_bytes(b"\0" * (free_bytes(mount) - room))
        messages: list[str] = []
        trainer.run(trainer.checkpointer(persist_every=2, log=messages.append), 0, 6)
        off = [m for m in messages if "in-memory snapshots turned off" in m]
        assert len(off) == 1 and "persistent saves every 2 steps go on" in off[0], messages
        assert [kind for line in capsys.readouterr().err.splitlines()
                if (event := worker_events.parse(line)) for kind in event[:1]] == ["snapshot_disabled"]
        assert [p.name for p in mount.iterdir()] == ["filler"], "a snapshot segment was left behind"
        assert [step for step, _ in complete_checkpoints(tmp_path / "checkpoints")] == [5, 3]
        again = Trainer(width=1024).checkpointer(log=messages.append)
        assert again.restore() == 6 and "persistent checkpoint" in again.restored_from
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_without_persistence_a_full_shared_memory_says_nothing_protects_progress(
        job: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mount = tmp_path / "shm"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        monkeypatch.setattr("convoy.shm.SHM_DIR", mount)
        messages: list[str] = []
        trainer = Trainer(width=1024)
        trainer.run(trainer.checkpointer(log=messages.append), 0, 2)
        assert [m for m in messages if "nothing protects progress now" in m], messages
        assert not list(mount.iterdir())
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_unreadable_newest_slot_falls_back_to_the_other_with_a_message(job: str) -> None:
    trainer = Trainer()
    trainer.run(trainer.checkpointer(), 0, 3)  # slots hold steps 1 and 2
    segment = next(SHM_DIR.glob(f"convoy-{job}-*"))
    reader = SnapshotFile(segment)
    index = max(range(2), key=lambda i: reader.slots()[i][0])
    _, step, data_len, meta_len, _ = reader.slots()[index]
    reader.close()
    assert step == 2
    with open(segment, "r+b") as handle:
        handle.seek(HEADER_SIZE + index * SnapshotFile(segment).slot_size + data_len)
        handle.write(b"\x07" * meta_len)  # what an overrun from the other slot would leave
    messages: list[str] = []
    ckpt = Trainer().checkpointer(log=messages.append)
    assert ckpt.restore() == 2 and "in-memory snapshot of step 1" in ckpt.restored_from
    assert any("unreadable" in m and "step 2" in m for m in messages), messages


class FenceThatLapsesDuringTheSave:
    """Allows a save to start, then refuses its seal: the lease lapsed while DCP was writing
    (scripted, since a real lease cannot lapse at that exact moment on demand)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def allows(self, what: str) -> bool:
        self.asked.append(what)
        return len(self.asked) == 1


def test_save_whose_lease_lapses_while_writing_is_not_sealed(job: str, tmp_path: Path) -> None:
    trainer = Trainer()
    ckpt = trainer.checkpointer(persist_every=2)
    ckpt._saver.fence = fence = FenceThatLapsesDuringTheSave()
    trainer.run(ckpt, 0, 2)
    assert fence.asked == ["persistent checkpoint of step 1"] * 2
    assert complete_checkpoints(tmp_path / "checkpoints") == []
    assert not list((tmp_path / "checkpoints").glob("step-*")), "the unsealed save was left behind"


def test_a_checkpointer_with_a_budget_says_its_k_and_loses_at_most_k_minus_1_steps(
        job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of ~2 ms and a snapshot of a model whose state is ~16 MiB: a snapshot every step would be far over 1%.
    The intervals are real, so k is whatever this machine measures; what is checked is what k implies."""
    monkeypatch.setattr(snapshot_budget, "RECHECK", 10)
    events: list[tuple[str, str]] = []
    monkeypatch.setattr("convoy.worker.events.emit", lambda kind, message: events.append((kind, message)))
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 2048)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = convoy.Checkpointer(model, optimizer, max_overhead=0.01)
    steps = 40
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 1024)).sum().backward()
        optimizer.step()
        time.sleep(0.002)
        ckpt.step(step)
    ckpt.close()
    budget = ckpt.budget
    assert budget is not None and budget.decision is not None
    said = [message for kind, message in events if kind == "snapshot_interval"]
    assert said and said[-1] == budget.decision.describe(), events
    assert f"snapshots every {budget.every} step(s)" in said[-1]
    again = convoy.Checkpointer(model, optimizer, max_overhead=0.01)
    resumed = again.restore()
    again.close()
    assert steps - budget.every <= resumed <= steps, "a failure after the last step loses at most k - 1 of them"
