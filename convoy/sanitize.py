"""What the control plane accepts as a name and how it prints text that came over the wire: a node id or host
holding a newline or an escape sequence would forge lines on the console and in ``convoy status``."""

from __future__ import annotations

import re

SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._@+-]*$"
"""Node ids: letters, digits and ``. _ @ + -``."""
SAFE_HOST = r"^[A-Za-z0-9._:%\[\]-]+$"
"""Hosts: names, IPv4 and IPv6 addresses (with brackets or a zone)."""
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_UNPRINTABLE_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return repr(char)[1:-1] if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def printable(text: str, keep_lines: bool = False) -> str:
    """``text`` with control characters written as escapes (``\\n``, ``\\x1b``); ``keep_lines`` leaves
    newlines and tabs, for text of several lines (a worker's last output) printed as such."""
    pattern = _UNPRINTABLE_BUT_LINES if keep_lines else _UNPRINTABLE
    return pattern.sub(_escape, text)


def safe_name(value: str) -> bool:
    return re.fullmatch(SAFE_NAME, value) is not None


def safe_host(value: str) -> bool:
    return re.fullmatch(SAFE_HOST, value) is not None
