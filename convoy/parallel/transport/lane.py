"""A shared-memory lane beside one connection, for a caller and a service on one host: the tensors of each request
and reply are written into a /dev/shm segment both sides have mapped, and only the header crosses the socket.

Opening (after the handshake, on the authenticated connection): the caller creates the segment (mode 0600, its pages
reserved at once, so a full /dev/shm fails here and not with SIGBUS later), writes a random token at its start and
sends ``_lane_open`` {path, bytes, token}. The service opens the path without following links, checks that it is a
regular file of this user in /dev/shm of the size said, maps it and reads the token back (the same memory, not a
file of the same name on another host), then answers ``_lane_opened`` or ``_lane_refused`` with why. Either way the
caller unlinks the name: both mappings outlive it, so nothing is left in /dev/shm when either side dies. A
connection without a lane carries its tensors itself.

A message over the lane has no tensors of its own; its meta's ``_lane`` lists [name, dtype, shape, offset] per
tensor, each checked against the lane's bounds before it is read. The reader copies each tensor out: the next
message overwrites the lane (one request in flight per connection, so a reply never meets its request's bytes).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

import torch

from convoy.parallel.transport.errors import BadMessage
from convoy.parallel.transport.wire import DTYPES, Limits, Message, parse_entry
from convoy.shm import SHM_DIR, create_mapped, segment_prefix

LANE_META = "_lane"
OPEN, OPENED, REFUSED = "_lane_open", "_lane_opened", "_lane_refused"
ALIGN = 64
"""Each tensor starts at a multiple of this (any dtype's view is aligned); the token takes the first block."""
TOKEN_BYTES = 16
MAX_LANE_BYTES = 1 << 30
NAME = re.compile(r"convoy-(?:[A-Za-z0-9_.-]+-)?lane-[0-9a-f]{32}")


class LaneRefused(Exception):
    """The service will not map the segment a caller named (the reason goes back in ``_lane_refused``)."""


class Lane:
    """One mapped segment of ``size`` bytes."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm, self.size = mm, len(mm)
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)

    @staticmethod
    def create(size: int, job_id: str | None = None) -> tuple[Lane, Path, bytes]:
        """A new segment in /dev/shm (the job's prefix, so that its end removes one a crash left named), its pages
        reserved, the token written; raises ``OSError`` (ENOSPC: /dev/shm is full) with nothing left behind."""
        size = max(ALIGN * 2, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
        prefix = segment_prefix(job_id) if job_id else "convoy-"
        path = SHM_DIR / f"{prefix}lane-{secrets.token_hex(16)}"
        mm = create_mapped(path, size)
        token = secrets.token_bytes(TOKEN_BYTES)
        mm[:TOKEN_BYTES] = token
        return Lane(mm), path, token

    @staticmethod
    def attach(meta: dict[str, Any], limits: Limits) -> Lane:
        """The service's side of ``_lane_open``: the caller's segment mapped, or ``LaneRefused`` saying why."""
        path, size, token = meta.get("path"), meta.get("bytes"), meta.get("token")
        if not (isinstance(path, str) and type(size) is int and isinstance(token, str)):
            raise LaneRefused("a lane is opened with {path: str, bytes: int, token: hex str}")
        where = Path(path)
        if where.parent != SHM_DIR or not NAME.fullmatch(where.name):
            raise LaneRefused(f"{path[:200]!r} is not a lane's segment in {SHM_DIR} (convoy-[JOB-]lane-HEX32)")
        bound = min(limits.message_bytes, MAX_LANE_BYTES)
        if not ALIGN * 2 <= size <= bound:
            raise LaneRefused(f"a lane of {size} bytes is outside this service's bounds ({ALIGN * 2} to {bound})")
        try:
            fd = os.open(where, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:  # another host's caller (no such file here), or a link
            raise LaneRefused(f"cannot open {path}: {os.strerror(exc.errno or errno.EIO)}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size != size:
                raise LaneRefused(f"{path} is not a regular file of this user of {size} bytes")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if not secrets.compare_digest(bytes(mm[:TOKEN_BYTES]), bytes.fromhex(token) if _is_hex(token) else b""):
            mm.close()
            raise LaneRefused(f"{path} does not hold the token the caller wrote: not the caller's memory")
        return Lane(mm)

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        return bool(tensors) and span(tensors) <= self.size

    def write(self, tensors: dict[str, torch.Tensor]) -> list[list[Any]]:
        """The tensors into the lane (the caller checked ``fits``); their entries for ``_lane``."""
        entries, at = [], ALIGN
        for name, tensor in tensors.items():
            flat = tensor.detach().contiguous().cpu().reshape(-1)
            size = flat.numel() * flat.element_size()
            if size:
                self.bytes[at:at + size].copy_(flat.view(torch.uint8))
            entries.append([name, str(flat.dtype), list(tensor.shape), at])
            at += -(-size // ALIGN) * ALIGN
        return entries

    def read(self, entries: Any, limits: Limits) -> dict[str, torch.Tensor]:
        """The tensors ``entries`` name, copied out (a caller cannot change what was checked after the check);
        ``BadMessage`` for an entry outside the lane or the bounds."""
        if not isinstance(entries, list) or len(entries) > limits.tensors:
            raise BadMessage(f"a lane message lists its tensors as [[name, dtype, shape, offset], ...], at most "
                             f"{limits.tensors}")
        tensors, total = {}, 0
        for item in entries:
            if not (isinstance(item, list) and len(item) == 4 and type(item[3]) is int):
                raise BadMessage(f"a lane entry {str(item)[:120]} is not [name, dtype, shape, offset]")
            name, dtype, shape = parse_entry(item[:3])
            offset, size = item[3], math.prod(shape) * DTYPES[dtype].itemsize
            if offset % ALIGN or not ALIGN <= offset <= self.size - size or name in tensors:
                raise BadMessage(f"lane entry {name!r}: {size} bytes at {offset} is not an aligned span of the "
                                 f"lane's {self.size} bytes after its token (or the name comes twice)")
            total += size
            if total > limits.message_bytes:
                raise BadMessage(f"a lane message of more than {limits.message_bytes} tensor bytes is over this "
                                 "side's bound (Limits.message_bytes)")
            tensors[name] = self.bytes[offset:offset + size].view(DTYPES[dtype]).reshape(shape).clone()
        return tensors

    def close(self) -> None:
        del self.bytes
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still out somewhere; the mapping goes with it


def span(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the lane that ``write`` would use, its token block included."""
    return ALIGN + sum(-(-(t.numel() * t.element_size()) // ALIGN) * ALIGN for t in tensors.values())


def _is_hex(text: str) -> bool:
    return len(text) == TOKEN_BYTES * 2 and all(c in "0123456789abcdef" for c in text)


def lane_in(lane: Lane | None, message: Message, limits: Limits) -> Message:
    """A received message with the tensors its ``_lane`` names; as it came when it names none."""
    if LANE_META not in message.meta:
        return message
    if lane is None:
        raise BadMessage("a message names tensors in a shared-memory lane, but this connection opened none")
    if message.tensors:
        raise BadMessage("a message carries tensors both on the socket and in its lane")
    meta = dict(message.meta)
    return Message(message.op, meta, lane.read(meta.pop(LANE_META), limits))


def lane_out(lane: Lane | None, message: Message) -> Message:
    """The message to send: its tensors in the lane when there is one and they fit, else as it is."""
    if lane is None or not lane.fits(message.tensors):
        return message
    return Message(message.op, {**message.meta, LANE_META: lane.write(message.tensors)})
