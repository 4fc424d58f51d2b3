"""Lossless coding of floating-point chunks for the slow phase of the hierarchical allreduce.

A float's top byte holds its sign and the high bits of its exponent, and across a gradient chunk
it takes few values: the magnitudes of most elements lie within a few binades of each other. Here
that byte is sent as a 4-bit code and the other bytes as they are, so a float32 chunk crosses in
7/8 of its size, a bfloat16 chunk in 3/4 (float64 in 15/16). Every bit comes back: the sum is the
same as without coding.

Code of an element whose top byte is ``t`` (sign ``s = t >> 7``, ``e = t & 0x7F``), with ``top``
the chunk's window of ``WINDOW`` values of ``e`` that holds the most elements:

    s << 3 | (top - e)    where top - WINDOW < e <= top
    0b0111                t == 0 (zeros, and positive values below 2^-125 in float32 and bfloat16)
    0b1111                anything else; the byte itself follows, in order, after the codes

A chunk where more than ``MAX_ESCAPED`` of the elements would escape goes raw (mode 0). The
payload starts with a header (``HEADER`` int64: mode, element count, escapes, top) so the
receiver, posting a buffer of the raw size, learns what came. ``encode`` and ``decode`` are pure;
``CodedSum`` sends a chunk so between the two ranks that sum it across a slow link.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

CODED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
WINDOW = 7
ZERO, ESCAPE = 7, 15
MAX_ESCAPED = 1 / 16
HEADER = 4
SAMPLE_EVERY = 8
_RAW, _CODED = 0, 1
_HEADER_BYTES = HEADER * 8


def codable(dtype: torch.dtype) -> bool:
    """Whether chunks of this dtype are coded (float16's top byte holds mantissa bits: too many values)."""
    return dtype in CODED_DTYPES


def capacity(count: int, dtype: torch.dtype) -> int:
    """Bytes a payload of ``count`` elements can take: the raw chunk and the header."""
    return _HEADER_BYTES + count * dtype.itemsize


def encode(chunk: torch.Tensor) -> torch.Tensor:
    """The payload (uint8) that carries the contiguous 1-D ``chunk``; ``decode`` gives it back bit for bit.

    Elementwise steps are uint8 arithmetic: a comparison costs several times more on a CPU, and coding
    must stay cheaper than the bytes it saves on the link (benchmarks/allreduce.py measures both)."""
    if not codable(chunk.dtype):
        raise ValueError(f"float_codec codes {', '.join(str(d) for d in CODED_DTYPES)}, not {chunk.dtype}")
    count, width = chunk.numel(), chunk.element_size()
    raw = chunk.view(torch.uint8).view(count, width)
    top_byte = raw[:, width - 1].contiguous()
    counts = torch.bincount(top_byte[::SAMPLE_EVERY], minlength=256)  # the window from a sample: any is lossless
    by_exponent = counts[:128] + counts[128:]
    by_exponent[0] -= counts[0]  # a zero byte has its own code wherever the window is
    window = by_exponent.cumsum(0)
    window[WINDOW:] -= window[:-WINDOW].clone()
    top = int(window.argmax())
    codes = torch.zeros(-(-count // _BLOCK) * _BLOCK, dtype=torch.uint8)
    below = torch.minimum(top - (top_byte & 0x7F), torch.tensor(ZERO, dtype=torch.uint8))  # wraps above top
    sign = top_byte >> 7
    nonzero = (top_byte | (0 - top_byte)) >> 7
    outside = (below + 1) >> 3
    # in the window: s << 3 | (top - e); outside it: 0b0111 for a zero byte, 0b1111 (escape) for the rest
    torch.bitwise_or((sign | (outside & nonzero)) << 3, below, out=codes[:count])
    flags = _escape_flags(codes)
    escapes = int(flags.sum())
    if escapes > count * MAX_ESCAPED or count < 2:
        payload = torch.empty(capacity(count, chunk.dtype), dtype=torch.uint8)
        payload[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor([_RAW, count, 0, 0]))
        payload[_HEADER_BYTES:].copy_(raw.view(-1))
        return payload
    packed_bytes = (count + 1) // 2
    low_bytes = count * (width - 1)
    payload = torch.empty(_HEADER_BYTES + low_bytes + packed_bytes + escapes, dtype=torch.uint8)
    payload[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor([_CODED, count, escapes, top]))
    body = payload[_HEADER_BYTES:]
    for plane, part in zip(_planes(chunk), _plane_parts(body, count, width), strict=True):
        part.copy_(plane)
    pairs = codes[:2 * packed_bytes].view(torch.int16)  # little-endian: code 2i in the low byte, 2i + 1 in the high
    body[low_bytes:low_bytes + packed_bytes] = ((pairs >> 4) | pairs).to(torch.uint8)
    if escapes:
        body[low_bytes + packed_bytes:] = top_byte[_escaped(flags)]
    return payload


def decode(payload: torch.Tensor, out: torch.Tensor) -> None:
    """Write the chunk carried by ``payload`` (possibly followed by unused bytes) into ``out``."""
    mode, count, escapes, top = payload[:_HEADER_BYTES].view(torch.int64).tolist()
    if mode not in (_RAW, _CODED):
        raise ValueError(f"not a float_codec payload (mode {mode})")
    if count != out.numel():
        raise ValueError(f"payload carries {count} elements; the chunk it belongs to has {out.numel()}")
    width = out.element_size()
    raw = out.view(torch.uint8).view(count, width)
    body = payload[_HEADER_BYTES:]
    if mode == _RAW:
        raw.view(-1).copy_(body[:count * width])
        return
    low_bytes, packed_bytes = count * (width - 1), (count + 1) // 2
    for plane, part in zip(_planes(out), _plane_parts(body, count, width), strict=True):
        plane.copy_(part)
    packed = body[low_bytes:low_bytes + packed_bytes].to(torch.int16)
    padded = torch.zeros(-(-count // _BLOCK) * _BLOCK, dtype=torch.uint8)
    padded[:2 * packed_bytes] = ((packed & 0x0F) | ((packed & 0xF0) << 4)).view(torch.uint8)
    codes = padded[:count]
    below = codes & 0x07
    inside = 1 - ((below + 1) >> 3)
    top_byte = (((codes >> 3) << 7) | (top - below)) * inside  # outside the window: 0, or the escaped byte
    if escapes:
        top_byte[_escaped(_escape_flags(padded))] = body[low_bytes + packed_bytes:low_bytes + packed_bytes + escapes]
    raw[:, width - 1] = top_byte


class CodedSum:
    """Add ``tensor`` to the same chunk on ``peer``, the one other rank of ``group``, sending it coded;
    a handle like an async ``all_reduce``'s (``wait``). Both ranks end with the same bits: each adds
    the other's chunk to its own, and float addition is commutative."""

    def __init__(self, tensor: torch.Tensor, group: Any, peer: int) -> None:
        self.tensor = tensor
        self.payload = encode(tensor)
        self.inbox = torch.empty(capacity(tensor.numel(), tensor.dtype), dtype=torch.uint8)
        self.sent = dist.isend(self.payload, peer, group=group)
        # gloo completes a receive into a larger buffer with the message it gets; the header says how much came
        self.received = dist.irecv(self.inbox, peer, group=group)

    def wait(self) -> None:
        self.received.wait()
        other = torch.empty_like(self.tensor)
        decode(self.inbox, other)
        self.tensor.add_(other)
        self.sent.wait()


_BLOCK = 1024
"""Escapes are looked for block by block, and only blocks that hold one are searched: a comparison over a
whole chunk alone would cost a sizeable share of coding it."""


def _escape_flags(codes: torch.Tensor) -> torch.Tensor:
    """1 where ``codes`` (padded with zeros to whole blocks) say ESCAPE, else 0; a row per block."""
    return ((codes + 1) >> 4).view(-1, _BLOCK)


def _escaped(flags: torch.Tensor) -> torch.Tensor:
    """Where the flags are set, in order."""
    blocks = flags.amax(1).nonzero().view(-1)
    within = flags[blocks].nonzero()
    return blocks[within[:, 0]] * _BLOCK + within[:, 1]


_INTS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _planes(chunk: torch.Tensor) -> list[torch.Tensor]:
    """Every byte of each element but the top one, as strided views of whole ints (bytes 0-1 and 2 of a
    float32; 0-3, 4-5 and 6 of a float64; 0 of a bfloat16): fewer, wider elements copy faster than
    the same bytes one by one."""
    width, planes, offset = chunk.element_size(), [], 0
    for size in (4, 2, 1):
        if width - 1 - offset >= size:
            planes.append(chunk.view(_INTS[size]).view(chunk.numel(), width // size)[:, offset // size])
            offset += size
    return planes


def _plane_parts(body: torch.Tensor, count: int, width: int) -> list[torch.Tensor]:
    """Where ``_planes`` go in the payload: one after another, each whole."""
    parts, offset, used = [], 0, 0
    for size in (4, 2, 1):
        if width - 1 - used >= size:
            parts.append(body[offset:offset + count * size].view(_INTS[size]))
            offset += count * size
            used += size
    return parts
