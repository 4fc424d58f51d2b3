"""Live updates as server-sent events, from one thread for every open page: a stream's socket leaves the API's
handler pool once its headers are sent, so open pages never hold the threads the agents' calls need. The count is
bounded; a client too slow to take its updates is dropped (its browser reconnects)."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from convoy.control.dashboard import views
from convoy.control.limits import close_connection

MAX_STREAMS = 16
"""Open pages at once (each its own stream); one more is refused with a 503 that says so."""
LOOP_S = 0.05
KEEPALIVE_S = 15.0
MAX_BUFFERED = 1 << 20
"""Bytes a stream may owe its client; past it the client is too slow and is dropped."""
DELTA_EVENTS = 200
DELTA_POINTS = 400


@dataclass
class Stream:
    sock: socket.socket
    job: str
    every_s: float
    cursor: tuple[Any, ...]
    next_due: float = 0.0
    last_sent: float = field(default_factory=time.monotonic)
    owed: bytes = b""


class Broadcaster:
    """Sends each stream what changed in its job since it last looked, at most every ``every_s`` it asked for."""

    def __init__(self, run_dir_of: Callable[[str], Path], max_streams: int = MAX_STREAMS) -> None:
        self._run_dir_of, self.max_streams = run_dir_of, max_streams
        self._lock = threading.Lock()
        self._streams: list[Stream] = []
        self._stopping = threading.Event()
        self._wake = threading.Event()
        """Set by a new stream and by ``stop``: the thread sleeps until the next stream is due, else."""
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self._connections: dict[str, Any] = {}
        self.fault = ""
        """Why the last look at a job failed ('' if none did): the next look tries again."""

    @property
    def count(self) -> int:
        return len(self._streams)

    def add(self, sock: socket.socket, job: str, every_s: float) -> bool:
        """Take an open page's socket (its response headers already sent); False when the streams are full."""
        with self._views(job) as db:
            cursor = views.probe(db)
        with self._lock:
            if len(self._streams) >= self.max_streams:
                return False
            sock.setblocking(False)
            stream = Stream(sock, job, every_s, cursor, next_due=_next_tick(time.monotonic(), every_s))
            stream.owed = _message("hello", {"cursor": list(cursor[:2]), "status": cursor[2][0],
                                             "round_id": cursor[2][1]})
            self._streams.append(stream)
            self._wake.set()  # its hello goes now
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="convoy-dashboard-stream", daemon=True)
                self._thread.start()
        return True

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(2.0)
        with self._lock:
            for stream in self._streams:
                close_connection(stream.sock)
            self._streams.clear()
        for db in self._connections.values():
            db.close()

    def _views(self, job: str) -> views.ReadOnly:
        return views.ReadOnly(self._run_dir_of(job))

    def _kept(self, job: str) -> Any:
        """The stream thread's own connection to a job's state file, opened once."""
        if job not in self._connections:
            self._connections[job] = views.connect(self._run_dir_of(job))
        return self._connections[job]

    def _loop(self) -> None:
        """Each pass serves the streams that are due, then sleeps until the next one is (``LOOP_S`` while a client
        still owes taking what it was sent): 3 pages at a 1 s refresh wake the thread once a second, not 20 times."""
        while not self._stopping.is_set():
            self._wake.wait(self._pause())
            self._wake.clear()
            if self._stopping.is_set():
                return
            now = time.monotonic()
            probes: dict[str, tuple[Any, ...]] = {}
            made: dict[tuple[Any, ...], bytes] = {}
            with self._lock:
                streams = list(self._streams)
            for stream in streams:
                if now >= stream.next_due and not stream.owed:
                    stream.next_due = _next_tick(now, stream.every_s)
                    try:
                        self._update(stream, probes, made, now)
                    except Exception as exc:  # noqa: BLE001 (a state file busy or gone for a moment: next look)
                        self.fault = f"{type(exc).__name__}: {exc}"
                if stream.owed and not self._flush(stream):
                    self._drop(stream)

    def _pause(self) -> float:
        with self._lock:
            streams = list(self._streams)
        if any(stream.owed for stream in streams):
            return LOOP_S
        due = min((stream.next_due for stream in streams), default=time.monotonic() + KEEPALIVE_S)
        return min(KEEPALIVE_S, max(0.0, due - time.monotonic()))

    def _update(self, stream: Stream, probes: dict[str, tuple[Any, ...]], made: dict[tuple[Any, ...], bytes],
                now: float) -> None:
        """What ``stream`` is owed: one look at its job per pass, and one message per (job, from, to) in a pass,
        so that pages of the same job at the same refresh (their ticks coincide) cost one query between them."""
        kept = self._kept(stream.job)
        if stream.job not in probes:
            probes[stream.job] = views.probe(kept)
        probe = probes[stream.job]
        if probe == stream.cursor:
            if now - stream.last_sent >= KEEPALIVE_S:
                stream.owed, stream.last_sent = b": keepalive\n\n", now
            return
        key = (stream.job, stream.cursor, probe)
        if key not in made:
            made[key] = self._news(stream.job, kept, stream.cursor, probe)
        stream.cursor, stream.owed, stream.last_sent = probe, made[key], now

    def _news(self, job: str, kept: Any, cursor: tuple[Any, ...], probe: tuple[Any, ...]) -> bytes:
        run_dir = self._run_dir_of(job)
        events_after, points_after = cursor[0], cursor[1]
        news: dict[str, Any] = {"cursor": list(probe[:2]), "status": probe[2][0], "round_id": probe[2][1]}
        if probe[0] != events_after:
            news["events"] = views.events(run_dir, after=events_after, limit=DELTA_EVENTS, kept=kept)["events"]
        if probe[1] != points_after:
            news["series"] = views.metrics(run_dir, after=points_after, upto=probe[1], per_task=DELTA_POINTS,
                                           kept=kept)["series"]
        return _message("update", news)

    def _flush(self, stream: Stream) -> bool:
        try:
            sent = stream.sock.send(stream.owed)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return False
        stream.owed = stream.owed[sent:]
        return len(stream.owed) <= MAX_BUFFERED

    def _drop(self, stream: Stream) -> None:
        with self._lock:
            if stream in self._streams:
                self._streams.remove(stream)
                self.dropped += 1
        close_connection(stream.sock)


def _next_tick(now: float, every_s: float) -> float:
    """The next multiple of ``every_s`` after ``now``: streams of the same refresh are due in the same pass."""
    return (int(now / every_s) + 1) * every_s


def _message(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
