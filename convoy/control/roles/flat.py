"""Flat dataclasses as dicts, for the roles' saved state: what ``dataclasses.asdict`` gives without its deep copy.

At 4096 role processes the master made the roles' state (a dict per process, several times over) in 330 ms with
``asdict``, which walks and copies every value; a process's records hold only strings, numbers and lists of them,
and the state is dumped to JSON at once, so their fields are read as they are."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

_NAMES: dict[type, tuple[str, ...]] = {}


def flat(record: Any) -> dict[str, Any]:
    """The fields of ``record``, a dataclass whose fields are plain values (no dataclass inside), by name. Its
    lists are shared, not copied: dump the result before the record changes."""
    kind = type(record)
    names = _NAMES.get(kind)
    if names is None:
        names = _NAMES[kind] = tuple(f.name for f in fields(record))
    return {name: getattr(record, name) for name in names}
