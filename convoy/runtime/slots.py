"""The file format of in-memory snapshots: a POSIX shared-memory segment with two slots per rank,
so that a kill never tears both (``snapshot.py`` takes and reads snapshots with it).

Layout of ``/dev/shm/convoy-<job>-rank<r>``: a header page, then two equal slots. A slot
holds the tensors' bytes (64-byte aligned) followed by a pickled skeleton of the state (the
nested structure with each tensor replaced by a ``TensorRef``). A slot's sequence number is
zeroed before it is written and set only after its last byte is in place, so a worker
killed mid-copy leaves the other slot, the previous complete snapshot, readable.

A slot can also be committed *partial*: its skeleton and the tensors not marked ``pending``
are in place, the pending ones (parameters and optimizer state, copied in the background) are
not yet. ``mark_complete`` flips it once they are. A partial slot still carries a rank's own
small state (data position, RNG) for a step whose replicated state a peer can supply.

Every write is bounds-checked against its slot (``SnapshotTooSmall``), and a slot whose lengths
do not fit it or whose skeleton fails its checksum reads as absent (``unreadable`` says why).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import pickle
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from convoy.errors import CheckpointError

MAGIC = b"CVYSNAP3"
HEADER_SIZE = 4096
ALIGN = 64
_HEADER = struct.Struct("<8sq")  # magic, slot size
_SLOT = struct.Struct("<qqqqqI")  # sequence (0: not valid), step, data length, meta length, complete, meta crc32


class SnapshotTooSmall(CheckpointError):
    """A write would run past the end of its slot; grow the segment (``allocate``) first."""


class SnapshotNoSpace(CheckpointError):
    """The segment's filesystem (``/dev/shm``) has no room for it; nothing of it is left behind."""


@dataclass(slots=True)
class TensorRef:
    """Where a slot holds one tensor of the state (read-only by use: made for every tensor at every step, a plain
    dataclass is made 4x quicker than a frozen one)."""

    index: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = -1
    pending: bool = False
    """Not yet written when the slot was committed partial."""

    def __reduce__(self) -> tuple[type, tuple[int, str, tuple[int, ...], int, int, bool]]:
        """Pickled as its fields (a snapshot's skeleton holds one per tensor, hundreds, written every step)."""
        return TensorRef, (self.index, self.dtype, self.shape, self.nbytes, self.offset, self.pending)


_NESTED = (dict, list, tuple)


def map_leaves(obj: Any, leaf_type: type, fn: Callable[[Any], Any]) -> Any:
    """Rebuild a nested dict/list/tuple with ``fn`` applied to every leaf of ``leaf_type``. (Each item is looked at
    in place, a call only for a leaf or a nested container: a snapshot walks its state every step.)"""
    if isinstance(obj, leaf_type):
        return fn(obj)
    if isinstance(obj, dict):
        return {key: fn(value) if isinstance(value, leaf_type) else
                map_leaves(value, leaf_type, fn) if isinstance(value, _NESTED) else value
                for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [fn(value) if isinstance(value, leaf_type) else
                 map_leaves(value, leaf_type, fn) if isinstance(value, _NESTED) else value for value in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def flatten(state: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace each tensor in a nested dict/list/tuple by a ``TensorRef``; collect the tensors."""

    def ref(tensor: torch.Tensor) -> TensorRef:
        tensors.append(tensor)
        dtype = str(tensor.dtype).removeprefix("torch.")
        return TensorRef(len(tensors) - 1, dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size())

    return map_leaves(state, torch.Tensor, ref)


@dataclass
class Placed:
    """A state laid out for a slot in one walk (``place``): each tensor a ``TensorRef`` at its aligned offset."""

    skeleton: Any
    tensors: list[torch.Tensor]
    offsets: list[int]
    data_len: int
    pending: frozenset[int]
    """The tensors ``place`` was told are written after the commit (the slot is partial until then)."""

    def meta(self) -> bytes:
        """The pickled skeleton a slot stores after its tensors (what ``encode_meta`` gives for the same state)."""
        return pickle.dumps(self.skeleton, protocol=pickle.HIGHEST_PROTOCOL)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def place(state: Any, later: Callable[[torch.Tensor], bool] | None = None) -> Placed:
    """``flatten``, ``layout`` and ``encode_meta``'s placing in one walk of ``state`` (a snapshot's host work
    per step is this walk and one pickle); ``later`` says which tensors are written after the commit."""
    tensors: list[torch.Tensor] = []
    offsets: list[int] = []
    pending: list[int] = []
    cursor = 0

    def ref(tensor: torch.Tensor) -> TensorRef:
        nonlocal cursor
        index, offset = len(tensors), cursor
        nbytes = tensor.nbytes
        dtype = _DTYPE_NAMES.get(tensor.dtype) or _DTYPE_NAMES.setdefault(
            tensor.dtype, str(tensor.dtype).removeprefix("torch."))
        waits = later is not None and later(tensor)
        tensors.append(tensor)
        offsets.append(offset)
        if waits:
            pending.append(index)
        cursor += -(-nbytes // ALIGN) * ALIGN
        return TensorRef(index, dtype, tuple(tensor.shape), nbytes, offset, waits)

    skeleton = map_leaves(state, torch.Tensor, ref)
    return Placed(skeleton, tensors, offsets, cursor, frozenset(pending))


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
        self.before_unmap: list[Callable[[int, int], None]] = []
        """Called with the mapping's address and size before it goes (CUDA unregisters its page-lock there)."""
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
        if self._bytes is not None:
            for hook in self.before_unmap:
                hook(self._bytes.data_ptr(), self._bytes.numel())
        self._bytes = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def allocate(self, slot_size: int) -> None:
        """(Re)create the segment with two slots of ``slot_size`` bytes; old contents are dropped.
        Raises ``SnapshotNoSpace`` when the filesystem cannot hold it, leaving no new file behind."""
        slot_size = -(-slot_size // mmap.PAGESIZE) * mmap.PAGESIZE
        total = HEADER_SIZE + 2 * slot_size
        current = self.size_on_disk()
        free = free_bytes(self.path.parent)
        if total > free + current:
            raise SnapshotNoSpace(f"a snapshot segment of {total / 2**20:.1f} MiB does not fit in {self.path.parent} "
                                  f"({free / 2**20:.1f} MiB free)")
        self.close()
        if total > free:  # the old segment's space is needed for the new one
            self.path.unlink(missing_ok=True)
        tmp = self.path.with_name(self.path.name + ".new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, total)
            os.posix_fallocate(fd, 0, total)  # fail now, not with SIGBUS later
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise SnapshotNoSpace(f"no space for a snapshot segment of {total / 2**20:.1f} MiB in "
                                      f"{self.path.parent}") from exc
            raise
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._mm = _mmap(self.path, total)
        _HEADER.pack_into(self._mm, 0, MAGIC, slot_size)
        self.slot_size = slot_size
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)

    def size_on_disk(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def remove(self) -> None:
        """Drop the segment (snapshots turned off): no stale snapshot may outlive newer state."""
        self.close()
        self.slot_size = 0
        self.path.unlink(missing_ok=True)

    def slots(self) -> list[tuple[int, int, int, int, int]]:
        """``(sequence, step, data_len, meta_len, complete)`` of both slots (sequence 0: empty or torn)."""
        if self._mm is None:
            return []
        return [_SLOT.unpack_from(self._mm, _HEADER.size + i * _SLOT.size)[:5] for i in range(2)]

    def _problem(self, index: int) -> str | None:
        """Why a written slot cannot be read (lengths outside the slot, skeleton overwritten), or None."""
        assert self._mm is not None
        seq, step, data_len, meta_len, _, crc = _SLOT.unpack_from(self._mm, _HEADER.size + index * _SLOT.size)
        if data_len < 0 or meta_len <= 0 or data_len + meta_len > self.slot_size:
            return f"slot {index} (step {step}) claims {data_len} + {meta_len} bytes in a {self.slot_size}-byte slot"
        start = HEADER_SIZE + index * self.slot_size + data_len
        if zlib.crc32(self._mm[start : start + meta_len]) != crc:
            return f"slot {index} (step {step}) fails its checksum (overwritten)"
        return None

    def unreadable(self) -> list[str]:
        """Why each written slot that reads as absent is unreadable (empty when both are fine)."""
        return [problem for index, (seq, *_) in enumerate(self.slots()) if seq > 0
                for problem in [self._problem(index)] if problem]

    def _readable(self) -> list[tuple[int, tuple[int, int, int, int, int]]]:
        return [(index, slot) for index, slot in enumerate(self.slots())
                if slot[0] > 0 and self._problem(index) is None]

    def steps(self, partial: bool = False) -> list[int]:
        """Steps of the complete snapshots held (``partial``: and of the partial ones), newest first."""
        readable = sorted((slot for _, slot in self._readable()), reverse=True)
        return [step for _, step, _, _, done in readable if done or partial]

    def fits(self, data_len: int, meta_len: int) -> bool:
        return self._mm is not None and data_len + meta_len <= self.slot_size

    def _check_bounds(self, end: int, what: str) -> None:
        if end > self.slot_size:
            raise SnapshotTooSmall(f"{what} ends at byte {end} of a slot: does not fit its {self.slot_size} bytes; "
                                   "grow the segment before writing")

    def begin(self, seq: int) -> int:
        """Pick the slot to overwrite (the older one) and mark it invalid; returns its index."""
        slots = self.slots()
        index = 0 if slots[0][0] <= slots[1][0] else 1
        _SLOT.pack_into(self._mm, _HEADER.size + index * _SLOT.size, 0, -1, 0, 0, 0, 0)  # type: ignore[arg-type]
        return index

    @property
    def segment(self) -> torch.Tensor | None:
        """The whole mapped segment as bytes (None: not mapped)."""
        return self._bytes

    def views(self, index: int, tensors: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
        """Host views of slot ``index`` shaped like ``tensors`` at ``offsets``, each bounds-checked."""
        assert self._bytes is not None
        base = HEADER_SIZE + index * self.slot_size
        sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
        for nbytes, offset in zip(sizes, offsets, strict=True):
            self._check_bounds(offset + nbytes, f"a tensor at offset {offset}")
        return [self._bytes[base + offset : base + offset + nbytes].view(tensor.dtype).view(tensor.shape)
                for tensor, nbytes, offset in zip(tensors, sizes, offsets, strict=True)]

    def write_tensors(self, index: int, tensors: list[torch.Tensor], offsets: list[int]) -> None:
        """Copy tensors into a slot, without the GIL, so that this can overlap compute (``copy_into``)."""
        for tensor, target in zip(tensors, self.views(index, tensors, offsets), strict=True):
            copy_into(target, tensor.detach())

    def commit(self, index: int, seq: int, step: int, skeleton: Any, offsets: list[int], data_len: int,
               pending: frozenset[int] = frozenset()) -> None:
        """Make a slot readable; with ``pending`` tensor indices it is partial until ``mark_complete``."""
        self.commit_meta(index, seq, step, encode_meta(skeleton, offsets, pending), data_len, not pending)

    def commit_meta(self, index: int, seq: int, step: int, meta: bytes, data_len: int, complete: bool) -> None:
        """``commit`` with the skeleton already encoded (``encode_meta``), so its length can size the slot."""
        assert self._mm is not None
        self._check_bounds(data_len + len(meta), f"the skeleton of step {step} ({len(meta)} bytes)")
        start = HEADER_SIZE + index * self.slot_size + data_len
        self._mm[start : start + len(meta)] = meta
        _SLOT.pack_into(self._mm, _HEADER.size + index * _SLOT.size, seq, step, data_len, len(meta), complete,
                        zlib.crc32(meta))

    def mark_complete(self, index: int) -> None:
        """The pending tensors of a partial slot are written now."""
        assert self._mm is not None
        offset = _HEADER.size + index * _SLOT.size
        seq, step, data_len, meta_len, _, crc = _SLOT.unpack_from(self._mm, offset)
        _SLOT.pack_into(self._mm, offset, seq, step, data_len, meta_len, 1, crc)

    def read(self, step: int, copy: bool = True, partial: bool = False) -> Any:
        """The state of the complete snapshot at ``step``, tensors copied out of shared memory
        (``copy=False``: views into it, valid until this slot is written again). ``partial``
        also reads a partial slot, with None in place of its pending tensors."""
        assert self._mm is not None and self._bytes is not None
        for index, (_, slot_step, data_len, meta_len, done) in self._readable():
            if slot_step == step and (done or partial):
                base = HEADER_SIZE + index * self.slot_size
                try:
                    skeleton = pickle.loads(self._mm[base + data_len : base + data_len + meta_len])
                except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as exc:
                    raise KeyError(f"snapshot of step {step} in {self.path} is unreadable: {exc}") from exc
                if not _refs_inside(skeleton, data_len):
                    raise KeyError(f"snapshot of step {step} in {self.path} points outside its slot")
                return _restore(skeleton, self._bytes, base, copy, drop_pending=not done)
        raise KeyError(f"no {'' if partial else 'complete '}snapshot of step {step} in {self.path}")


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer can still allocate in ``directory``'s filesystem."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def encode_meta(skeleton: Any, offsets: list[int], pending: frozenset[int] = frozenset()) -> bytes:
    """The pickled skeleton a slot stores after its tensors, each ``TensorRef`` placed at its offset."""
    placed = map_leaves(skeleton, TensorRef, lambda ref: TensorRef(ref.index, ref.dtype, ref.shape, ref.nbytes,
                                                                   offsets[ref.index], ref.index in pending))
    return pickle.dumps(placed, protocol=pickle.HIGHEST_PROTOCOL)


def _refs_inside(skeleton: Any, data_len: int) -> bool:
    refs: list[TensorRef] = []
    map_leaves(skeleton, TensorRef, refs.append)
    return all(0 <= ref.offset and ref.offset + ref.nbytes <= data_len for ref in refs)


def _restore(skeleton: Any, data: torch.Tensor, base: int, copy: bool, drop_pending: bool = False) -> Any:
    def copy_out(ref: TensorRef) -> torch.Tensor | None:
        if ref.pending and drop_pending:
            return None
        raw = data[base + ref.offset : base + ref.offset + ref.nbytes]
        view = raw.view(getattr(torch, ref.dtype)).view(ref.shape)
        return view.clone() if copy else view

    return map_leaves(skeleton, TensorRef, copy_out)


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` for a contiguous host view of the segment. A dense host tensor is copied with one
    ``memmove`` on the calling thread: ``copy_`` splits a large copy over torch's intra-op threads, which the
    training thread's operators use too, so a background copy queued its chunks among theirs and a step
    with many small operators waited for the whole copy (``benchmarks/hf_trainer.py``: +22% at 2 x 64 tokens)."""
    if (type(source) is torch.Tensor and source.device.type == "cpu" and source.layout == torch.strided
            and source.dtype == target.dtype and source.is_contiguous() and not source.is_conj()
            and not source.is_neg() and target.is_contiguous() and source.numel() == target.numel()):
        if source.numel():
            ctypes.memmove(target.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
        return
    target.copy_(source)
