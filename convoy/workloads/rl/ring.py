"""The replay buffer's ring in shared memory: the service keeps its columns in a /dev/shm segment, and a learner on
the same host maps it and gathers its own samples from it. The service draws the slots (its sum tree), the learner
copies the rows: the batch's bytes never go through the service or a socket.

Layout: a header (magic, a random token, the layout's JSON length, the capacity), the layout as JSON, then each
column and the ``written`` column (each row's insert number, -1 while it is being written), 64-byte aligned.

A row can be overwritten while a learner copies it (the ring wrapped meanwhile). The service sets the row's
``written`` to -1, writes the row, then sets its new number, with a memory fence between each step; the learner
copies its rows, then reads ``written`` again: a row whose number is no longer the one the service drew it with was
overwritten mid-copy, and is dropped from the batch (counted). x86 keeps loads in order and stores in order, and
the fences (``buffer.fence``) keep the row's bulk copy between the two stores.

A learner proves it maps the service's ring (not another host's file of the same name) by the token, which it gets
over the authenticated transport.
"""

from __future__ import annotations

import errno
import json
import mmap
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from convoy.errors import ConfigError
from convoy.shm import create_mapped, open_mapped
from convoy.workloads.rl.buffer import Layout

MAGIC = b"CVYRING1"
_HEADER = struct.Struct("<8s16sqq")  # magic, token, layout JSON bytes, capacity
HEADER_BYTES = 4096
ALIGN = 64


class RingNoSpace(ConfigError):
    """/dev/shm has no room for the ring: the buffer keeps its columns in its own memory and serves over the
    transport."""


@dataclass
class Gathered:
    batch: dict[str, torch.Tensor]
    kept: torch.Tensor
    """Per drawn row: True if it was read whole (its insert number did not change while it was copied)."""


def _offsets(layout: Layout, capacity: int, start: int) -> tuple[dict[str, int], int, int]:
    """Each column's byte offset, the ``written`` column's, and the total size."""
    at, offsets = start, {}
    for name, column in layout.columns.items():
        offsets[name] = at
        at += -(-(capacity * torch.Size(column.shape).numel() * column.dtype.itemsize) // ALIGN) * ALIGN
    written_at = at
    return offsets, written_at, written_at + capacity * 8


class SharedRing:
    """A mapped ring: ``columns`` and ``written`` are views of the segment."""

    def __init__(self, path: Path, mm: mmap.mmap, layout: Layout, capacity: int, token: bytes,
                 data_at: int) -> None:
        self.path, self.mm, self.layout, self.capacity, self.token = path, mm, layout, capacity, token
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)
        offsets, written_at, _ = _offsets(layout, capacity, data_at)
        self.columns = {}
        for name, column in layout.columns.items():
            size = capacity * torch.Size(column.shape).numel() * column.dtype.itemsize
            self.columns[name] = self.bytes[offsets[name]:offsets[name] + size].view(column.dtype).view(
                capacity, *column.shape)
        self.written = self.bytes[written_at:written_at + capacity * 8].view(torch.int64)

    @staticmethod
    def create(path: Path, layout: Layout, capacity: int) -> SharedRing:
        described = json.dumps(layout.describe()).encode()
        data_at = -(-(HEADER_BYTES + len(described)) // mmap.PAGESIZE) * mmap.PAGESIZE
        total = _offsets(layout, capacity, data_at)[2]
        try:
            mm = create_mapped(path, total)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise RingNoSpace(f"no room in {path.parent} for the replay ring of {total / 2**20:.0f} MiB") from exc
            raise
        token = secrets.token_bytes(16)
        _HEADER.pack_into(mm, 0, MAGIC, token, len(described), capacity)
        mm[HEADER_BYTES:HEADER_BYTES + len(described)] = described
        ring = SharedRing(path, mm, layout, capacity, token, data_at)
        ring.written.fill_(-1)
        return ring

    @staticmethod
    def open(path: str | Path, token: bytes) -> SharedRing:
        """The service's ring at ``path``, if it holds ``token``; ``ConfigError`` naming why not (another host's
        path, an old ring, not a ring)."""
        where = Path(path)
        try:
            mm = open_mapped(where)
        except OSError as exc:
            raise ConfigError(f"cannot open the replay ring {where}: {exc.strerror}") from exc
        except ValueError as exc:  # an empty file cannot be mapped
            raise ConfigError(f"{where} is not a replay ring (empty)") from exc
        size = len(mm)
        if size < HEADER_BYTES:
            mm.close()
            raise ConfigError(f"{where} is not a replay ring ({size} bytes)")
        magic, held, described_bytes, capacity = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or not secrets.compare_digest(held, token) or not 0 < described_bytes < size:
            mm.close()
            raise ConfigError(f"{where} is not the replay service's ring (its magic or token differs)")
        layout = Layout.from_description(json.loads(bytes(mm[HEADER_BYTES:HEADER_BYTES + described_bytes])))
        data_at = -(-(HEADER_BYTES + described_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        if _offsets(layout, capacity, data_at)[2] != size:
            mm.close()
            raise ConfigError(f"{where}: its layout and its size do not agree")
        return SharedRing(where, mm, layout, capacity, token, data_at)

    def gather(self, slots: torch.Tensor, written: torch.Tensor) -> Gathered:
        """The rows at ``slots`` as the service drew them (insert numbers ``written``); ``kept`` marks those read
        whole."""
        if slots.dim() != 1 or slots.shape != written.shape or (slots.numel() and (
                int(slots.min()) < 0 or int(slots.max()) >= self.capacity)):
            raise ConfigError(f"slots out of the ring's {self.capacity} rows, or not one per insert number")
        batch = {name: torch.index_select(column, 0, slots) for name, column in self.columns.items()}
        return Gathered(batch, torch.index_select(self.written, 0, slots) == written)

    def close(self) -> None:
        del self.bytes, self.columns, self.written
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still out somewhere; the mapping goes with it

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
