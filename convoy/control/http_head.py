"""An HTTP/1.1 request head split into its fields with a few string operations, and a reply written as one block:
the master's front door screens the head it has read, and its handler answers from it. (http.server's parse, run by
the front door and again by the handler through the email parser, was a third of the master's time per request.)"""

from __future__ import annotations

import time
from http import HTTPStatus

_DATE = (0, "")
"""(the second, its HTTP date): the Date header, made once a second."""


class Head:
    """A request line and its header fields (names in lower case; a repeated field keeps its last value)."""

    __slots__ = ("method", "target", "version", "fields")

    def __init__(self, method: str, target: str, version: str, fields: dict[str, str]) -> None:
        self.method, self.target, self.version, self.fields = method, target, version, fields

    def get(self, name: str, default: str = "") -> str:
        return self.fields.get(name.lower(), default)

    @property
    def keep_alive(self) -> bool:
        """Whether the client keeps the connection after this request (HTTP/1.1 unless it says close)."""
        connection = self.get("connection").lower()
        if self.version == "HTTP/1.0":
            return connection == "keep-alive"
        return connection != "close"


def parse_head(block: bytes) -> Head:
    """The head of a request from its bytes up to the blank line; a ValueError says what is malformed."""
    lines = block.decode("latin-1").split("\n")
    parts = lines[0].rstrip("\r").split()
    if len(parts) != 3:
        raise ValueError("malformed request line")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        line = line.rstrip("\r")
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or line[0] in " \t":
            raise ValueError("malformed header field")
        fields[name.lower()] = value.strip()
    return Head(parts[0], parts[1], parts[2], fields)


def reply_head(code: int, length: int, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """The status line and header block of a JSON reply of ``length`` bytes."""
    global _DATE
    now = int(time.time())
    if _DATE[0] != now:
        _DATE = (now, time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)))
    lines = [f"HTTP/1.1 {code} {HTTPStatus(code).phrase}", "Server: convoy", f"Date: {_DATE[1]}",
             *(f"{name}: {value}" for name, value in extra),
             "Content-Type: application/json", f"Content-Length: {length}", "", ""]
    return "\r\n".join(lines).encode("latin-1")
