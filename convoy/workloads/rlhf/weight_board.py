"""The newest weights in shared memory on one host: the trainer packs each version straight into one of two slots of
a /dev/shm segment (the buckets of ``buckets.Manifest``, laid end to end), and every rollout on the host copies it
from there into its shadow model: one copy out per rollout, no message per parameter, no socket.

Layout: a header page (magic, the manifest's length, a slot's size, the current version and its digest, and each
slot's sequence number), the manifest as JSON, then the two slots. A writer makes a slot's sequence odd before it
writes and even after, and only then names the version current; a reader copies the current slot and keeps the copy
only if that slot's sequence was the same even number before and after (else the writer came round to it meanwhile
and the reader copies again). A reader never sees half a version; the writer never waits for a reader.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from convoy.errors import ConfigError
from convoy.shm import create_mapped, open_mapped
from convoy.workloads.rlhf.buckets import Manifest, digest

MAGIC = b"CVYWGHT1"
HEADER_BYTES = 4096
ALIGN = 64
_HEADER = struct.Struct("<8sqqq16s")  # magic, manifest bytes, slot bytes, current version (-1: none), digest
_SEQ = struct.Struct("<q")
SEQ_AT = (_HEADER.size + 7) // 8 * 8
VERSION_AT = SEQ_AT + 16
DIGEST_AT = VERSION_AT + 16
"""Each slot's version and digest, written while its sequence is odd (a reader keeps what it read under an even
sequence that did not change)."""
ID_AT = DIGEST_AT + 32
"""16 random bytes written once at creation: a process that finds a board by its path knows it is the one the
trainer named (a rollout on another host than trainer 0 finds none, or another, and reads over the transport)."""
READ_TRIES = 100


class SlotView(NamedTuple):
    version: int
    digest: str
    buckets: list[torch.Tensor]
    """Views of the board's slot."""
    slot: int
    seq: int
    """The slot's sequence when the views were taken (even)."""


class WeightBoardNoSpace(ConfigError):
    """/dev/shm has no room for the board: the weights go over the transport instead."""


def _layout(manifest: Manifest) -> tuple[list[int], int]:
    """Each bucket's byte offset in a slot, and the slot's size."""
    offsets, at = [], 0
    for dtype, numel in manifest.buckets:
        offsets.append(at)
        at += -(-(numel * dtype.itemsize) // ALIGN) * ALIGN
    return offsets, at


class WeightBoard:
    """One host's board at ``path``; ``create`` (the trainer's rank 0) or ``open`` (a rollout)."""

    def __init__(self, path: Path, mm: mmap.mmap, manifest: Manifest, data_at: int, slot_bytes: int) -> None:
        self.path, self.mm, self.manifest = path, mm, manifest
        self.data_at, self.slot_bytes = data_at, slot_bytes
        self.offsets, _ = _layout(manifest)
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self.read_digest = ""
        """The digest the trainer wrote with the version ``read_into`` returned last."""

    @staticmethod
    def create(path: Path, manifest: Manifest) -> WeightBoard:
        described = json.dumps(manifest.describe()).encode()
        _, slot_bytes = _layout(manifest)
        data_at = -(-(HEADER_BYTES + len(described)) // mmap.PAGESIZE) * mmap.PAGESIZE
        total = data_at + 2 * slot_bytes
        tmp = path.with_name(path.name + ".new")
        tmp.unlink(missing_ok=True)  # a creation cut short before
        try:
            mm = create_mapped(tmp, total)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise WeightBoardNoSpace(f"no room in {path.parent} for a weight board of {total / 2**20:.0f} MiB") \
                    from exc
            raise
        _HEADER.pack_into(mm, 0, MAGIC, len(described), slot_bytes, -1, bytes(16))
        mm[ID_AT:ID_AT + 16] = os.urandom(16)
        mm[HEADER_BYTES:HEADER_BYTES + len(described)] = described
        os.replace(tmp, path)
        return WeightBoard(path, mm, manifest, data_at, slot_bytes)

    @staticmethod
    def open(path: Path) -> WeightBoard:
        try:
            mm = open_mapped(path)
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise ConfigError(f"cannot map the weight board {path}: {exc}") from exc
        size = len(mm)
        if size < HEADER_BYTES:
            mm.close()
            raise ConfigError(f"{path} is not a weight board ({size} bytes)")
        magic, described_bytes, slot_bytes, _, _ = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or not 0 < described_bytes <= size - HEADER_BYTES:
            mm.close()
            raise ConfigError(f"{path} is not a weight board (magic {magic!r})")
        manifest = Manifest.from_description(json.loads(bytes(mm[HEADER_BYTES:HEADER_BYTES + described_bytes])))
        data_at = -(-(HEADER_BYTES + described_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        if _layout(manifest)[1] != slot_bytes or data_at + 2 * slot_bytes != size:
            mm.close()
            raise ConfigError(f"{path}: its manifest and its size do not agree")
        return WeightBoard(path, mm, manifest, data_at, slot_bytes)

    def _seq(self, slot: int) -> int:
        return _SEQ.unpack_from(self.mm, SEQ_AT + 8 * slot)[0]

    def _set_seq(self, slot: int, value: int) -> None:
        _SEQ.pack_into(self.mm, SEQ_AT + 8 * slot, value)

    @property
    def board_id(self) -> str:
        return bytes(self.mm[ID_AT:ID_AT + 16]).hex()

    def current(self) -> tuple[int, str]:
        """The current version (-1: none yet) and its digest."""
        _, _, _, version, hashed = _HEADER.unpack_from(self.mm, 0)
        return version, hashed.hex()

    def _buckets(self, slot: int) -> list[torch.Tensor]:
        base = self.data_at + slot * self.slot_bytes
        return [self.bytes[base + at:base + at + numel * dtype.itemsize].view(dtype)
                for at, (dtype, numel) in zip(self.offsets, self.manifest.buckets, strict=True)]

    def publish(self, version: int, named: Mapping[str, torch.Tensor], hashed: bool = True) -> str:
        """The trainer's weights as ``version`` (newer than the current one); returns the digest of what it wrote
        (the bytes read once more and hashed before the version is named current: 0.4 s for 540 MB here), which the
        slot and the header hold with the version ("" with ``hashed`` False: no digest, zeros in its place)."""
        current, _ = self.current()
        if version <= current:
            raise ConfigError(f"version {version} is not newer than the board's {current}")
        slot = version % 2
        self._set_seq(slot, self._seq(slot) + 1)  # odd: being written
        _SEQ.pack_into(self.mm, VERSION_AT + 8 * slot, version)
        buckets = self.manifest.pack(named, self._buckets(slot))
        said = digest(buckets) if hashed else ""
        raw = bytes.fromhex(said) if said else bytes(16)
        self.mm[DIGEST_AT + 16 * slot:DIGEST_AT + 16 * slot + 16] = raw
        self._set_seq(slot, self._seq(slot) + 1)  # even: whole
        _HEADER.pack_into(self.mm, 0, MAGIC, *_HEADER.unpack_from(self.mm, 0)[1:3], version, raw)
        return said

    def current_view(self) -> SlotView | None:
        """The current version's slot as views of the board (None before the first version), for a copy made
        elsewhere: the writer comes round to that slot two versions on, so whoever copies the views asks
        ``unchanged`` once the copy is made, and keeps it only if so."""
        for _ in range(READ_TRIES):
            version, _ = self.current()
            if version < 0:
                return None
            slot = version % 2
            before = self._seq(slot)
            if before % 2 == 0:
                held = _SEQ.unpack_from(self.mm, VERSION_AT + 8 * slot)[0]
                hashed = bytes(self.mm[DIGEST_AT + 16 * slot:DIGEST_AT + 16 * slot + 16]).hex()
                if self._seq(slot) == before:
                    return SlotView(int(held), hashed, self._buckets(slot), slot, before)
            time.sleep(0.001)
        raise ConfigError(f"the weight board at {self.path} changed under {READ_TRIES} reads in a row")

    def unchanged(self, slot: int, seq: int) -> bool:
        """Whether ``slot`` was not written since its sequence was ``seq`` (what a ``current_view`` copy asks)."""
        return self._seq(slot) == seq

    def read_into(self, named: Mapping[str, torch.Tensor], have: int) -> int | None:
        """If a version newer than ``have`` is current: copy it into ``named`` (checked against the manifest first)
        and return its number (its digest in ``read_digest``); None when there is nothing newer."""
        self.manifest.check(named)
        for _ in range(READ_TRIES):
            version, _ = self.current()
            if version <= have:
                return None
            slot = version % 2
            before = self._seq(slot)
            if before % 2 == 0:
                held = _SEQ.unpack_from(self.mm, VERSION_AT + 8 * slot)[0]  # the newest, or one two versions on
                hashed = bytes(self.mm[DIGEST_AT + 16 * slot:DIGEST_AT + 16 * slot + 16]).hex()
                self.manifest.unpack(self._buckets(slot), named)
                if self._seq(slot) == before:  # the writer did not come round to this slot meanwhile
                    self.read_digest = hashed
                    return int(held)
            time.sleep(0.001)  # the trainer is writing this slot: the next version is almost there
        raise ConfigError(f"the weight board at {self.path} changed under {READ_TRIES} reads in a row")

    def digest_of(self, named: Mapping[str, torch.Tensor]) -> str:
        """The digest of ``named``'s own weights as this board packs them: equal to a version's digest when they are
        that version bit for bit."""
        return self.manifest.digest_of(named)

    def close(self) -> None:
        del self.bytes
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still out; the mapping goes with it

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
