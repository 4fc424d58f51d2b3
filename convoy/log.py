"""convoy's own messages go through ``logging`` (the logger ``convoy``); the workers' output does not.

``--log-level debug|info|warning|error`` (or ``CONVOY_LOG_LEVEL``, which the launcher's master and agents inherit,
so one flag sets the whole job's) picks what is shown. Info goes to standard output, as the job's story
(``convoy: round 1: ...``); warnings and errors go to standard error. A message is its line as it is, with no
prefix added: each already says who speaks (``convoy:``, ``convoy agent NODE:``). At debug level each line is
prefixed by the time and the level, to follow a job's steps.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

LOGGER = logging.getLogger("convoy")
LEVEL_ENV = "CONVOY_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
_handlers: list[logging.Handler] = []


class _Stream(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the stream ``sys.stdout`` or ``sys.stderr`` is at the time (tests and callers may swap them)."""

    def __init__(self, name: str) -> None:
        self._which = name
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return getattr(sys, self._which)

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always the current sys stream


def setup(level: str | None = None) -> None:
    """Show convoy's messages from ``level`` up (default: ``$CONVOY_LOG_LEVEL``, else info); children inherit it."""
    name = (level or os.environ.get(LEVEL_ENV) or "info").lower()
    if name not in LEVELS:
        name = "info"
    os.environ[LEVEL_ENV] = name
    for handler in _handlers:
        LOGGER.removeHandler(handler)
    _handlers.clear()
    fmt = "%(asctime)s %(levelname)s %(message)s" if name == "debug" else "%(message)s"
    out, err = _Stream("stdout"), _Stream("stderr")
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(logging.Formatter(fmt))
        LOGGER.addHandler(handler)
        _handlers.append(handler)
    LOGGER.setLevel(getattr(logging, name.upper()))
    LOGGER.propagate = False


def _ready() -> None:
    if not _handlers:
        setup()


def debug(message: str) -> None:
    _ready()
    LOGGER.debug(message)


def info(message: str) -> None:
    _ready()
    LOGGER.info(message)
    _flush()


def warning(message: str) -> None:
    _ready()
    LOGGER.warning(message)
    _flush()


def error(message: str) -> None:
    _ready()
    LOGGER.error(message)
    _flush()


def _flush() -> None:
    for handler in _handlers:
        handler.flush()
