"""In-memory snapshots in POSIX shared memory, two slots per rank so a kill never tears both.

Layout of ``/dev/shm/convoy-<job>-rank<r>``: a header page, then two equal slots. A slot
holds the tensors' bytes (64-byte aligned) followed by a pickled skeleton of the state (the
nested structure with each tensor replaced by a ``TensorRef``). A slot's sequence number is
zeroed before it is written and set only after its last byte is in place, so a worker
killed mid-copy leaves the other slot, the previous complete snapshot, readable.

A slot can also be committed *partial*: its skeleton and the tensors not marked ``pending``
are in place, the pending ones (parameters and optimizer state, copied in the background) are
not yet. ``mark_complete`` flips it once they are. A partial slot still carries a rank's own
small state (data position, RNG) for a step whose replicated state a peer can supply.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

MAGIC = b"CVYSNAP2"
HEADER_SIZE = 4096
ALIGN = 64
_HEADER = struct.Struct("<8sq")  # magic, slot size
_SLOT = struct.Struct("<qqqqq")  # sequence (0: not valid), step, data length, meta length, complete


@dataclass(frozen=True)
class TensorRef:
    index: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = -1
    pending: bool = False
    """Not yet written when the slot was committed partial."""


def map_leaves(obj: Any, leaf_type: type, fn: Callable[[Any], Any]) -> Any:
    """Rebuild a nested dict/list/tuple with ``fn`` applied to every leaf of ``leaf_type``."""
    if isinstance(obj, leaf_type):
        return fn(obj)
    if isinstance(obj, dict):
        return {key: map_leaves(value, leaf_type, fn) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [map_leaves(value, leaf_type, fn) for value in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def flatten(state: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace each tensor in a nested dict/list/tuple by a ``TensorRef``; collect the tensors."""

    def ref(tensor: torch.Tensor) -> TensorRef:
        tensors.append(tensor)
        dtype = str(tensor.dtype).removeprefix("torch.")
        return TensorRef(len(tensors) - 1, dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size())

    return map_leaves(state, torch.Tensor, ref)


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    return map_leaves(skeleton, TensorRef, lambda ref: tensors[ref.index])


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Aligned byte offsets of each tensor in a slot, and the data length."""
    offsets, cursor = [], 0
    for tensor in tensors:
        offsets.append(cursor)
        cursor += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return offsets, cursor


def _mmap(path: Path, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class SnapshotFile:
    """One rank's two-slot snapshot segment. Not thread-safe; one writer at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self.slot_size = 0
        if path.exists():
            self._map()

    def _map(self) -> None:
        """Map an existing segment; one that is too short or not ours is ignored."""
        size = self.path.stat().st_size
        if size < HEADER_SIZE:
            return
        self._mm = _mmap(self.path, size)
        magic, self.slot_size = _HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC or HEADER_SIZE + 2 * self.slot_size != size:
            self.close()
            self.slot_size = 0
            return
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)

    def close(self) -> None:
        self._bytes = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def allocate(self, slot_size: int) -> None:
        """(Re)create the segment with two slots of ``slot_size`` bytes; old contents are dropped."""
        self.close()
        slot_size = -(-slot_size // mmap.PAGESIZE) * mmap.PAGESIZE
        tmp = self.path.with_name(self.path.name + ".new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, HEADER_SIZE + 2 * slot_size)
            os.posix_fallocate(fd, 0, HEADER_SIZE + 2 * slot_size)  # fail now, not with SIGBUS later
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._mm = _mmap(self.path, HEADER_SIZE + 2 * slot_size)
        _HEADER.pack_into(self._mm, 0, MAGIC, slot_size)
        self.slot_size = slot_size
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)

    def slots(self) -> list[tuple[int, int, int, int, int]]:
        """``(sequence, step, data_len, meta_len, complete)`` of both slots (sequence 0: empty or torn)."""
        if self._mm is None:
            return []
        return [_SLOT.unpack_from(self._mm, _HEADER.size + i * _SLOT.size) for i in range(2)]

    def steps(self, partial: bool = False) -> list[int]:
        """Steps of the complete snapshots held (``partial``: and of the partial ones), newest first."""
        return [step for seq, step, _, _, done in sorted(self.slots(), reverse=True) if seq > 0 and (done or partial)]

    def fits(self, data_len: int, meta_len: int) -> bool:
        return self._mm is not None and data_len + meta_len <= self.slot_size

    def begin(self, seq: int) -> int:
        """Pick the slot to overwrite (the older one) and mark it invalid; returns its index."""
        slots = self.slots()
        index = 0 if slots[0][0] <= slots[1][0] else 1
        _SLOT.pack_into(self._mm, _HEADER.size + index * _SLOT.size, 0, -1, 0, 0, 0)  # type: ignore[arg-type]
        return index

    def write_tensors(self, index: int, tensors: list[torch.Tensor], offsets: list[int]) -> None:
        """Copy tensors into a slot (``copy_`` runs without the GIL, so this can overlap compute)."""
        assert self._bytes is not None
        base = HEADER_SIZE + index * self.slot_size
        for tensor, offset in zip(tensors, offsets, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            target = self._bytes[base + offset : base + offset + nbytes]
            target.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())

    def commit(self, index: int, seq: int, step: int, skeleton: Any, offsets: list[int], data_len: int,
               pending: frozenset[int] = frozenset()) -> None:
        """Make a slot readable; with ``pending`` tensor indices it is partial until ``mark_complete``."""
        assert self._mm is not None
        placed = map_leaves(skeleton, TensorRef,
                            lambda ref: replace(ref, offset=offsets[ref.index], pending=ref.index in pending))
        meta = pickle.dumps(placed, protocol=pickle.HIGHEST_PROTOCOL)
        start = HEADER_SIZE + index * self.slot_size + data_len
        self._mm[start : start + len(meta)] = meta
        _SLOT.pack_into(self._mm, _HEADER.size + index * _SLOT.size, seq, step, data_len, len(meta), not pending)

    def mark_complete(self, index: int) -> None:
        """The pending tensors of a partial slot are written now."""
        assert self._mm is not None
        seq, step, data_len, meta_len, _ = self.slots()[index]
        _SLOT.pack_into(self._mm, _HEADER.size + index * _SLOT.size, seq, step, data_len, meta_len, 1)

    def read(self, step: int, copy: bool = True, partial: bool = False) -> Any:
        """The state of the complete snapshot at ``step``, tensors copied out of shared memory
        (``copy=False``: views into it, valid until this slot is written again). ``partial``
        also reads a partial slot, with None in place of its pending tensors."""
        assert self._mm is not None and self._bytes is not None
        for index, (seq, slot_step, data_len, meta_len, done) in enumerate(self.slots()):
            if seq > 0 and slot_step == step and (done or partial):
                base = HEADER_SIZE + index * self.slot_size
                skeleton = pickle.loads(self._mm[base + data_len : base + data_len + meta_len])
                return _restore(skeleton, self._bytes, base, copy, drop_pending=not done)
        raise KeyError(f"no {'' if partial else 'complete '}snapshot of step {step} in {self.path}")


def _restore(skeleton: Any, data: torch.Tensor, base: int, copy: bool, drop_pending: bool = False) -> Any:
    def copy_out(ref: TensorRef) -> torch.Tensor | None:
        if ref.pending and drop_pending:
            return None
        raw = data[base + ref.offset : base + ref.offset + ref.nbytes]
        view = raw.view(getattr(torch, ref.dtype)).view(ref.shape)
        return view.clone() if copy else view

    return map_leaves(skeleton, TensorRef, copy_out)
