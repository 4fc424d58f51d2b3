"""The two-slot shared-memory snapshot format, without any process group."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import pytest
import torch

from convoy.runtime.slots import (
    _HEADER, _SLOT, HEADER_SIZE, SnapshotFile, SnapshotTooSmall, copy_into, flatten, layout, unflatten,
)
from convoy.shm import SHM_DIR, remove_segments, segment_path


@pytest.fixture
def job_id() -> Iterator[str]:
    job = f"test{uuid.uuid4().hex[:8]}"
    yield job
    remove_segments(job)


def _state(value: float) -> dict[str, object]:
    return {
        "w": torch.full((3, 5), value),
        "nested": [torch.arange(4, dtype=torch.int64) + int(value), {"b": torch.ones(2, dtype=torch.bfloat16)}],
        "flag": (torch.tensor([True, False]),),
        "step": int(value),
        "name": "x",
    }


def _write(snapshot: SnapshotFile, seq: int, step: int, state: dict[str, object], commit: bool = True) -> None:
    tensors: list[torch.Tensor] = []
    skeleton = flatten(state, tensors)
    offsets, data_len = layout(tensors)
    if not snapshot.fits(data_len, 4096):
        snapshot.allocate(data_len + 8192)
    index = snapshot.begin(seq)
    snapshot.write_tensors(index, tensors, offsets)
    if commit:
        snapshot.commit(index, seq, step, skeleton, offsets, data_len)


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_flatten_round_trip_keeps_structure_and_values() -> None:
    state = _state(2.0)
    tensors: list[torch.Tensor] = []
    skeleton = flatten(state, tensors)
    assert len(tensors) == 4
    _assert_same(unflatten(skeleton, tensors), state)
    offsets, data_len = layout(tensors)
    assert all(offset % 64 == 0 for offset in offsets) and data_len >= sum(t.nbytes for t in tensors)


def test_snapshot_survives_reopen_in_another_file_object(job_id: str) -> None:
    path = segment_path(job_id, 0)
    _write(SnapshotFile(path), seq=1, step=7, state=_state(7.0))
    reader = SnapshotFile(path)
    assert reader.steps() == [7]
    _assert_same(reader.read(7), _state(7.0))


def test_torn_write_leaves_previous_snapshot_readable(job_id: str) -> None:
    path = segment_path(job_id, 0)
    writer = SnapshotFile(path)
    _write(writer, 1, 10, _state(10.0))
    _write(writer, 2, 11, _state(11.0))
    assert writer.steps() == [11, 10]
    _write(writer, 3, 12, _state(12.0), commit=False)  # killed mid-copy: slot of step 10 is overwritten
    reader = SnapshotFile(path)
    assert reader.steps() == [11]
    _assert_same(reader.read(11), _state(11.0))
    with pytest.raises(KeyError):
        reader.read(10)


def test_partial_slot_holds_only_what_was_written_until_marked_complete(job_id: str) -> None:
    path = segment_path(job_id, "node-local0")
    writer = SnapshotFile(path)
    _write(writer, 1, 3, _state(3.0))
    state = _state(4.0)
    tensors: list[torch.Tensor] = []
    skeleton = flatten(state, tensors)
    offsets, data_len = layout(tensors)
    index = writer.begin(2)
    writer.write_tensors(index, tensors[1:], offsets[1:])  # "w" (tensor 0) is copied in the background
    writer.commit(index, 2, 4, skeleton, offsets, data_len, pending=frozenset({0}))
    reader = SnapshotFile(path)
    assert reader.steps() == [3] and reader.steps(partial=True) == [4, 3]
    with pytest.raises(KeyError):
        reader.read(4)
    partial = reader.read(4, partial=True)
    assert partial["w"] is None
    _assert_same(partial["nested"], state["nested"])
    writer.write_tensors(index, tensors[:1], offsets[:1])
    writer.mark_complete(index)
    assert reader.steps() == [4, 3]
    _assert_same(reader.read(4), state)


def test_foreign_or_short_segment_is_ignored(job_id: str) -> None:
    path = segment_path(job_id, 0)
    path.write_bytes(b"not a snapshot" * 400)
    assert SnapshotFile(path).steps() == []
    path.write_bytes(b"\0" * (HEADER_SIZE - 1))
    assert SnapshotFile(path).steps() == []


def test_remove_segments_only_touches_its_job(job_id: str) -> None:
    other = f"other{uuid.uuid4().hex[:8]}"
    _write(SnapshotFile(segment_path(job_id, 0)), 1, 1, _state(1.0))
    _write(SnapshotFile(segment_path(job_id, 1)), 1, 1, _state(1.0))
    _write(SnapshotFile(segment_path(other, 0)), 1, 1, _state(1.0))
    try:
        assert {p.name for p in remove_segments(job_id)} == {f"convoy-{job_id}-rank0", f"convoy-{job_id}-rank1"}
        assert segment_path(other, 0).exists()
        assert not list(Path(SHM_DIR).glob(f"convoy-{job_id}-*"))
    finally:
        remove_segments(other)


def test_a_write_past_its_slot_is_refused_and_the_other_slot_stays_readable(job_id: str) -> None:
    path = segment_path(job_id, 0)
    writer = SnapshotFile(path)
    _write(writer, 1, 1, _state(1.0))  # slot 0, slot size a few pages
    big = {"order": list(range(300_000))}  # a sampler's index list: its pickle is far larger than the slot
    tensors: list[torch.Tensor] = []
    skeleton = flatten(big, tensors)
    index = writer.begin(2)
    assert index == 1
    with pytest.raises(SnapshotTooSmall, match="does not fit"):
        writer.commit(index, 2, 2, skeleton, [], 0)
    with pytest.raises(SnapshotTooSmall, match="does not fit"):
        writer.write_tensors(index, [torch.zeros(writer.slot_size)], [0])
    reader = SnapshotFile(path)
    assert reader.steps() == [1]
    _assert_same(reader.read(1), _state(1.0))


def _corrupt_meta(path: Path, index: int) -> None:
    with open(path, "r+b") as segment:
        raw = bytearray(segment.read())
        _, slot_size = _HEADER.unpack_from(raw, 0)
        _, _, data_len, meta_len, *_ = _SLOT.unpack_from(raw, _HEADER.size + index * _SLOT.size)
        start = HEADER_SIZE + index * slot_size + data_len
        raw[start : start + meta_len] = b"\x07" * meta_len  # what an overrun from the other slot leaves
        segment.seek(0)
        segment.write(raw)


def test_an_unreadable_slot_counts_as_absent_with_the_reason(job_id: str) -> None:
    path = segment_path(job_id, 0)
    writer = SnapshotFile(path)
    _write(writer, 1, 10, _state(10.0))
    _write(writer, 2, 11, _state(11.0))
    _corrupt_meta(path, 1)  # the slot of step 11
    reader = SnapshotFile(path)
    assert reader.steps() == [10] and reader.steps(partial=True) == [10]
    assert any("step 11" in problem for problem in reader.unreadable()), reader.unreadable()
    _assert_same(reader.read(10), _state(10.0))
    with pytest.raises(KeyError):
        reader.read(11)


def test_slot_lengths_outside_the_slot_count_as_absent(job_id: str) -> None:
    path = segment_path(job_id, 0)
    writer = SnapshotFile(path)
    _write(writer, 1, 10, _state(10.0))
    _write(writer, 2, 11, _state(11.0))
    with open(path, "r+b") as segment:
        raw = bytearray(segment.read())
        seq, step, data_len, meta_len, done, crc = _SLOT.unpack_from(raw, _HEADER.size)
        _SLOT.pack_into(raw, _HEADER.size, seq, step, data_len, meta_len + writer.slot_size, done, crc)
        segment.seek(0)
        segment.write(raw)
    reader = SnapshotFile(path)
    assert reader.steps() == [11]
    assert any("step 10" in problem for problem in reader.unreadable()), reader.unreadable()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(64, 33),  # dense: one memmove
    lambda: torch.randn(33, 64).t(),  # transposed: not contiguous
    lambda: torch.randn(64, 64)[:, ::2],  # strided
    lambda: torch.randn(8, dtype=torch.complex64).conj(),  # a conjugate view: its bit must be applied
    lambda: torch.randn(8)._neg_view(),  # a negative view likewise
    lambda: torch.empty(0, 7),  # nothing to copy
    lambda: torch.arange(10, dtype=torch.int16),
    lambda: torch.nn.Parameter(torch.randn(5)).detach(),
])
def test_a_tensor_copied_into_a_view_of_the_segment_is_equal_however_it_is_laid_out(make) -> None:  # noqa: ANN001
    source = make()
    data = torch.zeros(source.numel() * source.element_size() + 16, dtype=torch.uint8)
    target = data[16:].view(source.dtype).view(source.shape)
    copy_into(target, source)
    assert torch.equal(target, source.resolve_conj().resolve_neg())
    assert int(data[:16].sum()) == 0, "nothing written outside the view"
