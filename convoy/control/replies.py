"""Answers kept by idempotency key, so that a POST retried after a lost reply is handled once."""

from __future__ import annotations

import collections
import gzip
import struct
import threading
import zlib

MAX_KEY_LENGTH = 128
MAX_REPLIES = 4096
MAX_REPLY_BYTES = 16 << 20
"""Bounds on what is kept: the oldest answers are forgotten first (a retry comes within seconds)."""
IN_FLIGHT_WAIT_S = 75.0
"""How long a repeat waits for the first call of its key to finish (longer than any long poll)."""


GZIP_AT = 64 << 10
"""Replies this long go compressed to a client that accepts gzip (a round's membership: 4096 nodes, 0.35 MB)."""


class Encoded(bytes):
    """A reply encoded once and sent as it is to many callers (a round's membership, the same for every node);
    ``gzipped``: the same compressed once, where it is long enough to be sent so."""

    gzipped: bytes | None = None


def encoded_once(data: bytes) -> Encoded:
    reply = Encoded(data)
    reply.gzipped = gzip.compress(data, 6, mtime=0) if len(data) >= GZIP_AT else None
    return reply


GZIP_HEAD = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
"""A gzip member's header (RFC 1952): deflate, no flags, no time, unknown system."""


_DEFLATING = threading.Lock()


class Tail(bytes):
    """The end of many replies whose heads differ (a wave of the roles' addresses, the bulk of every heartbeat reply
    at thousands of processes); ``deflated``: the same as a raw deflate stream that ends the data, made once, on
    the first reply long enough to go compressed."""

    _deflated: bytes | None = None

    @property
    def deflated(self) -> bytes:
        """Made by the first of the handler threads that send it; the others wait for it rather than make it too."""
        with _DEFLATING:
            if self._deflated is None:
                packer = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
                self._deflated = packer.compress(self) + packer.flush(zlib.Z_FINISH)
            return self._deflated


class Joined(Encoded):
    """``head + tail``, whose gzip form is the head deflated now and the tail's deflated once: one gzip member whose
    head's blocks end byte-aligned (a sync flush), then the tail's blocks, which refer only to the tail's own bytes.
    At 4096 processes compressing each heartbeat reply whole took 6 s of the master's time while the nodes learnt
    the addresses."""

    def __new__(cls, head: bytes, tail: Tail) -> Joined:
        reply = super().__new__(cls, head + tail)
        reply._head_length, reply._tail = len(head), tail
        return reply

    @property  # type: ignore[override]
    def gzipped(self) -> bytes | None:
        if len(self) < GZIP_AT:
            return None
        head = self[:self._head_length]
        packer = zlib.compressobj(1, zlib.DEFLATED, -zlib.MAX_WBITS)
        blocks = packer.compress(head) + packer.flush(zlib.Z_SYNC_FLUSH)
        check = zlib.crc32(self._tail, zlib.crc32(head))
        return GZIP_HEAD + blocks + self._tail.deflated + struct.pack("<II", check, len(self) & 0xFFFFFFFF)


class ReplyCache:
    """key -> (status, reply bytes) of calls the master has handled; thread-safe and bounded.

    A repeat that arrives while the first call of its key is still being handled waits for
    that call's answer instead of running the call a second time.
    """

    def __init__(self, max_replies: int = MAX_REPLIES, max_bytes: int = MAX_REPLY_BYTES) -> None:
        self.max_replies, self.max_bytes = max_replies, max_bytes
        self._replies: collections.OrderedDict[str, tuple[int, bytes, bool]] = collections.OrderedDict()
        self._bytes = 0
        self._in_flight: set[str] = set()
        self._changed = threading.Condition()

    def begin(self, key: str) -> tuple[int, bytes, bool] | None:
        """The kept ``(status, reply, written)`` for ``key``; else None, and the caller handles the
        call and must ``finish``. ``written``: whether the call's state was on disk when answered."""
        with self._changed:
            self._changed.wait_for(lambda: key not in self._in_flight, IN_FLIGHT_WAIT_S)
            kept = self._replies.get(key)
            if kept is not None:
                return kept
            self._in_flight.add(key)
            return None

    def finish(self, key: str, status: int, data: bytes | None, written: bool = True) -> None:
        """Keep the answer of ``key`` (None: keep nothing, a repeat runs the call again)."""
        with self._changed:
            self._in_flight.discard(key)
            if data is not None:
                self._replies[key] = (status, data, written)
                self._bytes += len(data)
                while self._replies and (len(self._replies) > self.max_replies or self._bytes > self.max_bytes):
                    self._bytes -= len(self._replies.popitem(last=False)[1][1])
            self._changed.notify_all()

    def mark_written(self, key: str) -> None:
        """The state of ``key``'s call has reached the disk since it was answered."""
        with self._changed:
            kept = self._replies.get(key)
            if kept is not None and not kept[2]:
                self._replies[key] = (kept[0], kept[1], True)
