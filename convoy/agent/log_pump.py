"""A worker's output: its log file, the console (one line per consequent failure) and the last lines for a failure
report, read from the worker's pipe by a thread (``LogPump``); ``Failures`` holds a node round's first failure."""

from __future__ import annotations

import collections
import errno
import os
import queue
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from convoy.worker.events import MARK, parse

TAIL_LINES = 20
HELD_LINES = 1000
"""Lines kept from a standby that has no rank yet; older ones are dropped."""
LOG_REOPEN_S = 1.0
"""How often a log file that could not be opened is tried again."""


PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "connectfullmesh",
             "connection refused", "socket timeout", "ncclremoteerror", "nccl communicator was aborted",
             "gloo/transport", "read error")
"""What a worker's last lines say when it failed because a peer was gone (lowercase)."""
TRACE_LINES = 400
TRACE_START = b"Traceback (most recent call last):"


def peer_lost(tail: Iterable[str]) -> bool:
    """Whether a worker's last lines say it failed because a peer was gone."""
    return any(mark in line.lower() for line in tail for mark in PEER_LOST)


class Failures:
    """The first failure of a node's round, so that the workers that fail after it because their peer is gone
    are one console line each (their full output stays in their log files)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.first: tuple[int, str] | None = None

    def claim(self, rank: int, what: str) -> None:
        with self._lock:
            if self.first is None:
                self.first = (rank, what)

    def reset(self) -> None:
        with self._lock:
            self.first = None


class LogPump(threading.Thread):
    """Copies a worker's output to its log file and, prefixed with its rank, to the console.

    Lines printed before the worker has a rank (e.g. import warnings) are held, then written.
    A line that records an event (``convoy.worker.events``) is also put on ``events`` as
    ``(rank, kind, message)`` for the agent to send to the master.
    The pump never stops reading (a worker blocks once its pipe is full): a line the log file
    cannot take (a full disk) is dropped from the file and counted, its console copy still goes out.
    """

    def __init__(self, stream: BinaryIO, console: BinaryIO, console_lock: threading.Lock,
                 events: queue.SimpleQueue[tuple[int, str, str]] | None = None,
                 failures: Failures | None = None) -> None:
        super().__init__(name="convoy-log", daemon=True)
        self._stream, self._console, self._console_lock = stream, console, console_lock
        self._failures = failures
        self._trace: list[bytes] | None = None
        """A traceback being printed: held off the console until it is known to be the first failure's."""
        self._trace_ended = False
        self._events = events
        self.rank = -1
        self._lock = threading.Lock()
        self._held: collections.deque[bytes] = collections.deque(maxlen=HELD_LINES)
        self._assigned = False
        self._file: BinaryIO | None = None
        self._prefix = b""
        self._show = True
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.log_path = ""
        self.dropped_lines = 0
        """Lines not written to the log file since it last took one (0 while writing works)."""
        self._log_error = ""
        self._next_open_at = 0.0

    def assign(self, rank: int, log_path: Path, label: str = "", show: bool = True) -> None:
        """``label``: the console prefix's name (a role process's ``ps0``); default ``rank<N>``; ``show``: False
        keeps the output off the console (its log file has it all)."""
        with self._lock:
            self._show = show
            self._prefix = f"[{label or f'rank{rank}'}]: ".encode()  # torch prefixes its own errors the same way
            self.rank = rank
            self.log_path = str(log_path)
            self._assigned = True
            self._open()
            held, self._held = list(self._held), collections.deque(maxlen=HELD_LINES)
            for line in held:
                self._write(line)

    def run(self) -> None:
        mark = MARK.encode()
        for line in iter(self._stream.readline, b""):
            event = None
            if self._events is not None and mark in line[:64]:
                event = parse(line.decode(errors="replace"))
                if event is not None:
                    self._events.put((self.rank, *event))
            with self._lock:
                if not self._assigned:
                    self._held.append(line)
                else:
                    self._write(line, console=event is None)  # the master prints a recorded event itself
        with self._lock:
            self._settle_trace(ended=True)
            if self.dropped_lines:
                self._say(f"{self.dropped_lines} lines not written to {self.log_path} ({self._log_error})")
            if self._file is not None:
                self._close_file()
        self._stream.close()

    def _open(self) -> None:
        """Open the log file (unbuffered: a failed write leaves nothing behind to retry)."""
        self._next_open_at = time.monotonic() + LOG_REOPEN_S
        try:
            Path(self.log_path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # the owner's only
            self._file = open(fd, "ab", buffering=0)  # noqa: SIM115 (closed when the stream ends)
        except OSError as exc:
            self._log_failed(exc)

    def _write(self, line: bytes, console: bool = True) -> None:
        if self._file is None and time.monotonic() >= self._next_open_at:
            self._open()
        if self._file is not None:
            try:
                written = self._file.write(line)
            except OSError as exc:
                self._log_failed(exc)
            else:
                if written is not None and written < len(line):  # the disk filled up inside this line
                    self._log_failed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
                elif self.dropped_lines:
                    self._say(f"{self.log_path} is writable again; {self.dropped_lines} lines not written to it")
                    self.dropped_lines, self._log_error = 0, ""
        else:
            self.dropped_lines += 1
        self.tail.append(line.decode(errors="replace").rstrip("\n"))
        if console and self._show and not self._held_back(line):
            self._to_console(line if line.startswith(self._prefix) else self._prefix + line)

    def _held_back(self, line: bytes) -> bool:
        """Whether ``line`` belongs to a traceback held off the console (a printed traceback the process goes on
        after is let out as soon as it does)."""
        if self._failures is None:
            return False
        text = line.removeprefix(self._prefix)
        if self._trace is None:
            if not text.startswith(TRACE_START):
                return False
            self._trace, self._trace_ended = [], False
        elif self._trace_ended and not text.startswith(TRACE_START):
            self._settle_trace(ended=False)
            return False
        if len(self._trace) < TRACE_LINES:
            self._trace.append(line)
        stripped = text.strip()
        self._trace_ended = bool(stripped) and not text[:1].isspace() and not stripped.startswith(
            (b"Traceback", b"During handling", b"The above exception"))
        return True

    def _settle_trace(self, ended: bool) -> None:
        """A held traceback: to the console, or (the process ended, its peer was gone after another rank's failure)
        one line for it."""
        trace, self._trace = self._trace, None
        if not trace:
            return
        text = b"".join(trace).decode(errors="replace")
        first = self._failures.first if self._failures is not None else None
        if ended and first is not None and first[0] != self.rank and any(mark in text.lower() for mark in PEER_LOST):
            last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
            self._say(f"lost its peer after {first[1]}: {last[:160]} (its whole output: {self.log_path})")
            return
        if ended and self._failures is not None:
            self._failures.claim(self.rank, f"rank {self.rank} failed")
        for line in trace:
            self._to_console(line if line.startswith(self._prefix) else self._prefix + line)

    def _log_failed(self, exc: OSError) -> None:
        if not self.dropped_lines and not self._log_error:
            self._log_error = exc.strerror or str(exc)
            self._say(f"cannot write to {self.log_path} ({self._log_error}); dropping lines from the log file, "
                      "the console copy goes on")
        self.dropped_lines += 1

    def _say(self, message: str) -> None:
        self._to_console(self._prefix + f"convoy: {message}".encode())

    def _to_console(self, text: bytes) -> None:
        try:
            with self._console_lock:
                self._console.write(text if text.endswith(b"\n") else text + b"\n")
                self._console.flush()
        except (OSError, ValueError):
            pass  # the agent's own output is gone or full: the worker must still not block

    def _close_file(self) -> None:
        assert self._file is not None
        try:
            self._file.close()
        except OSError:
            pass
        self._file = None
