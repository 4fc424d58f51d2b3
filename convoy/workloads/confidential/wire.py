"""The bytes on the enclave's one channel: length-prefixed JSON frames, and arrays packed without pickle.

Everything here validates what it reads and raises ``MessageError`` naming the problem, so a malformed
frame or payload is refused like any other bad message and the reader keeps going.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import socket
import struct
import zipfile
from typing import Any

import numpy as np

from convoy.workloads.confidential.errors import MessageError

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30
"""A frame announcing more than this is refused (and its bytes skipped), so a bad length cannot exhaust memory."""
_CHUNK = 1 << 20


def send_frame(sock: socket.socket, message: dict[str, Any]) -> int:
    """Write one JSON frame; returns the bytes sent (header included)."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise MessageError(f"message of {len(body)} bytes is over the {MAX_FRAME_BYTES}-byte frame limit; send "
                           "fewer rows per message")
    sock.sendall(HEADER.pack(len(body)) + body)
    return HEADER.size + len(body)


def send_raw_frame(sock: socket.socket, body: bytes) -> None:
    """Write arbitrary bytes as a frame (tests use it to send what a broken or hostile peer would)."""
    sock.sendall(HEADER.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    parts, left = [], size
    while left:
        part = sock.recv(min(left, _CHUNK))
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """Read one frame; None when the peer closed the channel. A frame that is too large, not JSON, or not a
    JSON object raises ``MessageError`` after it was consumed, so the stream stays in step."""
    return recv_frame_sized(sock)[0]


def recv_frame_sized(sock: socket.socket) -> tuple[dict[str, Any] | None, int]:
    """``recv_frame`` and the frame's size in bytes (header included)."""
    header = _recv_exact(sock, HEADER.size)
    if header is None:
        return None, 0
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        left = size
        while left:  # skip it in chunks, never holding it
            part = sock.recv(min(left, _CHUNK))
            if not part:
                return None, 0
            left -= len(part)
        raise MessageError(f"frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit; it was skipped")
    body = _recv_exact(sock, size)
    if body is None:
        return None, 0
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MessageError(f"frame is not valid JSON ({exc}); each frame must be one JSON object") from exc
    if not isinstance(message, dict):
        raise MessageError(f"frame is a JSON {type(message).__name__}, not an object with an 'op' field")
    return message, HEADER.size + size


def canonical_json(fields: dict[str, Any]) -> bytes:
    """One byte string per value (sorted keys, no spaces): what signatures and associated data cover."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: object, what: str) -> bytes:
    """Decode a base64 field, refusing anything that is not strictly base64."""
    if not isinstance(text, str):
        raise MessageError(f"{what} must be a base64 string (got {type(text).__name__})")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MessageError(f"{what} is not valid base64: {exc}") from exc


def unhex(text: object, what: str, size: int | None = None) -> bytes:
    """Decode a hex field of ``size`` bytes (any size when None)."""
    if not isinstance(text, str):
        raise MessageError(f"{what} must be a hex string (got {type(text).__name__})")
    try:
        data = bytes.fromhex(text)
    except ValueError as exc:
        raise MessageError(f"{what} is not valid hex") from exc
    if size is not None and len(data) != size:
        raise MessageError(f"{what} must be {size} bytes (got {len(data)})")
    return data


def field(message: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``message[name]``, which must exist and be of ``kind`` (bool never counts as int)."""
    if name not in message:
        raise MessageError(f"message lacks the field {name!r}")
    value = message[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise MessageError(f"field {name!r} must be {' or '.join(k.__name__ for k in kinds)} "
                           f"(got {type(value).__name__})")
    return value


def pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """Arrays as an uncompressed ``.npz`` (no pickled objects)."""
    buffer = io.BytesIO()
    np.savez(buffer, **{name: np.asarray(array) for name, array in arrays.items()})
    return buffer.getvalue()


def unpack_arrays(data: bytes) -> dict[str, np.ndarray]:
    """The inverse of ``pack_arrays``; object arrays are refused (``allow_pickle=False``)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise MessageError(f"payload is not a valid array archive ({exc})") from exc
