"""The bytes of one message: an op name, a small JSON header and named tensors as raw bytes (no pickling), each
received in place into the tensor the service then uses. Every length comes from the peer, so each is checked
against ``Limits`` (and the tensors' sizes against their dtypes and shapes) before anything is allocated."""

from __future__ import annotations

import json
import math
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from convoy.parallel.transport.errors import BadMessage, ConnectionLost

HEADER_LENGTH = struct.Struct("!Q")
SIZE = struct.Struct("!Q")
DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                          torch.int64, torch.int32, torch.uint8, torch.bool)}
MAX_DIMS = 16
MAX_NAME_CHARS = 512


def half_of_memory() -> int:
    """Half the machine's memory: no one message of a job could be larger and still be used."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


@dataclass(frozen=True)
class Limits:
    """What one message may hold; a message past any bound is refused before its bytes are read."""

    header_bytes: int = 16 << 20
    """The JSON header (op, meta, the tensors' names, dtypes and shapes)."""
    tensors: int = 1 << 16
    """How many tensors."""
    message_bytes: int = field(default_factory=half_of_memory)
    """The tensors' bytes together (default: half the machine's memory)."""


HANDSHAKE_LIMITS = Limits(header_bytes=4096, message_bytes=0)
"""Before a caller has proven it holds the secret: a small header and nothing else."""


@dataclass
class Message:
    """One request or reply."""

    op: str
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def send_message(sock: socket.socket, message: Message) -> None:
    entries, buffers = [], []
    for name, tensor in message.tensors.items():
        flat = tensor.detach().contiguous().cpu()
        entries.append([name, str(flat.dtype), list(flat.shape)])
        buffers.append(memoryview(flat.reshape(-1).view(torch.uint8).numpy()) if flat.numel() else b"")
    header = json.dumps({"op": message.op, "meta": message.meta, "tensors": entries}).encode()
    sizes = [len(b) for b in buffers]
    sock.sendall(HEADER_LENGTH.pack(len(header)) + header + struct.pack(f"!{len(sizes)}Q", *sizes))
    for buffer in buffers:
        if len(buffer):
            sock.sendall(buffer)


@dataclass(frozen=True)
class Header:
    """A message's op and meta, and its tensors as announced (name, dtype, shape): nothing allocated for them yet."""

    op: str
    meta: dict[str, Any]
    entries: list[tuple[str, str, list[int]]]


def recv_message(sock: socket.socket, limits: Limits, into: Mapping[str, torch.Tensor] | None = None) -> Message:
    """The next message, its lengths checked against ``limits`` before each is read or allocated; a tensor that
    ``into`` holds under its name, of its dtype and size and contiguous, is received into that one (a caller that
    takes the same large tensors again and again faults their pages in once)."""
    return recv_tensors(sock, recv_header(sock, limits), limits, into)


def recv_header(sock: socket.socket, limits: Limits) -> Header:
    """The next message's header, its length checked against ``limits`` before it is read."""
    (length,) = HEADER_LENGTH.unpack(_recv_exact(sock, HEADER_LENGTH.size))
    if length > limits.header_bytes:
        raise BadMessage(f"a message header of {length} bytes is over this service's bound of {limits.header_bytes} "
                         f"(Limits.header_bytes); send a smaller header")
    return parse_header(bytes(_recv_exact(sock, length)), limits)


def recv_tensors(sock: socket.socket, header: Header, limits: Limits,
                 into: Mapping[str, torch.Tensor] | None = None) -> Message:
    """The tensors ``header`` announced, their sizes checked (``check_sizes``) before any is allocated."""
    entries = header.entries
    sizes = struct.unpack(f"!{len(entries)}Q", _recv_exact(sock, SIZE.size * len(entries))) if entries else ()
    check_sizes(entries, sizes, limits)
    tensors = {}
    for (name, dtype, shape), size in zip(entries, sizes, strict=True):
        given = (into or {}).get(name)
        if given is not None and given.dtype == DTYPES[dtype] and given.is_contiguous() and given.nbytes == size:
            raw = given.reshape(-1).view(torch.uint8)
        else:
            raw = torch.empty(size, dtype=torch.uint8)  # received in place: no zero-filled buffer, no copy after
        if size:
            _recv_into(sock, memoryview(raw.numpy()))
        tensors[name] = raw.view(DTYPES[dtype]).reshape(shape)
    return Message(header.op, header.meta, tensors)


def parse_header(raw: bytes, limits: Limits) -> Header:
    """A header from its bytes; a ``BadMessage`` naming what is wrong."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadMessage(f"the message header is not JSON ({str(exc)[:80]}); speak convoy's transport") from exc
    if not isinstance(header, dict) or not isinstance(header.get("op"), str) \
            or not isinstance(header.get("meta"), dict) or not isinstance(header.get("tensors"), list):
        raise BadMessage("the message header is not {op: str, meta: {...}, tensors: [...]}; speak convoy's transport")
    listed = header["tensors"]
    if len(listed) > limits.tensors:
        raise BadMessage(f"a message of {len(listed)} tensors is over this service's bound of {limits.tensors} "
                         f"(Limits.tensors)")
    entries = [parse_entry(item) for item in listed]
    if len({name for name, _, _ in entries}) != len(entries):
        raise BadMessage("a message names one tensor twice")
    return Header(header["op"], header["meta"], entries)


def parse_entry(item: Any) -> tuple[str, str, list[int]]:
    if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and len(item[0]) <= MAX_NAME_CHARS
            and item[1] in DTYPES and isinstance(item[2], list) and len(item[2]) <= MAX_DIMS
            and all(type(d) is int and d >= 0 for d in item[2])):
        raise BadMessage(f"a tensor entry {str(item)[:120]} is not [name, dtype, shape] with a dtype of "
                         f"{sorted(DTYPES)} and at most {MAX_DIMS} dimensions")
    return item[0], item[1], item[2]


def check_sizes(entries: list[tuple[str, str, list[int]]], sizes: tuple[int, ...], limits: Limits) -> None:
    """Each tensor's byte count is what its dtype and shape make, and all of them fit ``limits.message_bytes``."""
    total = 0
    for (name, dtype, shape), size in zip(entries, sizes, strict=True):
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if size != expected:
            raise BadMessage(f"tensor {name!r} is announced as {size} bytes but a {dtype} of shape {shape} is "
                             f"{expected}")
        total += size
    if total > limits.message_bytes:
        raise BadMessage(f"a message of {total} tensor bytes is over this service's bound of {limits.message_bytes} "
                         f"(Limits.message_bytes); send it in parts or give the service larger Limits")


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, size = 0, len(view)
    while got < size:
        count = sock.recv_into(view[got:], size - got)
        if count == 0:
            raise ConnectionLost("the peer closed the connection mid-message")
        got += count


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    _recv_into(sock, memoryview(data))
    return data
