"""``convoy.report(step, loss=...)``: a rank's training status, non-blocking, torch-free.

The training thread only appends a point to a bounded buffer and looks at the config file (``live_config``);
a daemon thread sends the buffer to the node's agent every ``FLUSH_S`` (the agent forwards it to the master).
A slow or dead agent or master never slows training: points beyond the buffer are dropped and counted, and
a send that fails is tried again with the next batch. Outside convoy it does nothing but apply nothing.
"""

from __future__ import annotations

import atexit
import collections
import math
import operator
import os
import sys
import threading
import time
from typing import Any

from convoy.control.protocol import training as tp
from convoy.errors import ConfigError, ConvoyError
from convoy.worker.agent_link import Link, link
from convoy.worker.live_config import LiveConfig, current

FLUSH_S = 0.5
"""How often the sender thread sends the points it has."""
MAX_BUFFER = 10_000
SEND_TIMEOUT_S = 10.0
"""A send the agent does not answer in this long is given up (its points are sent with the next one)."""
EXIT_FLUSH_S = 2.0
"""How long an exiting process waits for its last points to be sent."""
PARK_TIMEOUT_S = 120.0
"""How long a rank parked for a restart waits for its agent to stop it before it goes on without the change."""
_PAGE = os.sysconf("SC_PAGE_SIZE")


class Reporter:
    """The buffer and the thread that sends it."""

    def __init__(self, where: Link) -> None:
        self.link = where
        self.backend = type(where.backend)(f"http://{where.backend.host}:{where.backend.port}", where.backend.token,
                                           unreachable_s=SEND_TIMEOUT_S, call_timeout_s=SEND_TIMEOUT_S)
        self.points: collections.deque[Point] = collections.deque()
        """What ``report`` recorded: plain tuples (the training thread builds no model); the sender makes them
        StatusPoints."""
        self.dropped = 0
        self.parked: int | None = None
        self.early = 0
        """Points sent at once so far (a new process's first two: where it is, and its pace)."""
        self.refused = ""
        self.sends = 0
        """Reports sent (or tried): the sender's cost is per send, spread over the steps each one carries."""
        self._wake = threading.Event()
        self._sent = threading.Event()
        self._last: float | None = None
        self._thread = threading.Thread(target=self._run, name="convoy-report", daemon=True)
        self._thread.start()
        atexit.register(self.flush, EXIT_FLUSH_S)  # a script that ends (or raises) sends its last steps

    def add(self, point: Point) -> None:
        if len(self.points) >= MAX_BUFFER:
            self.points.popleft()
            self.dropped += 1
        self.points.append(point)

    def _run(self) -> None:
        while True:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            self._send()

    def _send(self) -> None:
        if self.refused:  # this process is no longer the job's: what it reports would be refused again
            self.points.clear()
            self._sent.set()
            return
        taken = [_status_point(self.points.popleft()) for _ in range(min(len(self.points), tp.MAX_POINTS))]
        live = _live_config()
        switched = live.take_switched() if live is not None else {}
        if not taken and not switched and self.parked is None:
            self._sent.set()
            return
        if taken:
            taken[-1].memory_bytes = _rss()
        self.sends += 1
        dropped, self.dropped = self.dropped, 0
        report = tp.StatusReport(**self.link.task, sent_at=time.time(), points=taken, dropped=dropped,
                                 switched=switched, parked=self.parked)
        try:
            answer = self.backend.call("/train/report", report, tp.StatusAck)
        except ConvoyError:  # the agent or master is slow or gone: these points go with the next send
            self.points.extendleft(reversed([_point_tuple(point) for point in taken]))
            self.dropped += dropped
            if live is not None:
                live.switched = switched | live.switched
            return
        if isinstance(answer, str):  # refused: this process is no longer the job's (an ended round)
            self.refused = answer
        self._sent.set()

    def wake(self) -> None:
        """Send what there is now, not at the next interval (the training thread does not wait)."""
        self._wake.set()

    def flush(self, timeout: float) -> bool:
        """Send now; True once a send has landed."""
        self._sent.clear()
        self._wake.set()
        return self._sent.wait(timeout)


_reporter: Reporter | None = None
_last_report: float | None = None


def _live_config() -> LiveConfig | None:
    return current()


def report(step: int, loss: Any = None, *, samples: int | None = None, grad_norm: Any = None,
           **metrics: Any) -> None:
    """Record that ``step`` finished (with its loss, the samples it trained, a gradient norm, other numbers);
    a hot config change due at the next step is set on the config object before this returns."""
    global _reporter, _last_report
    now = time.monotonic()
    where = link()
    if where is not None:
        if _reporter is None:
            _reporter = Reporter(where)
        step = _step(step)
        step_time = now - _last_report if _last_report is not None else None
        value = _number(loss, "loss")
        speed = samples / step_time if samples and step_time else None
        _reporter.add((step, time.time(), value, step_time, speed, _number(grad_norm, "grad_norm"),
                       _metrics(metrics) if metrics else None))
        if _urgent(value):  # the rules judge it soon: a diverging run must be caught within a few steps
            _reporter.wake()
        elif _reporter.early < 2:  # the first two points go at once: the master plans config steps by them
            _reporter.early += 1
            _reporter.wake()
    live = current()
    if live is not None:
        due = live.boundary(step)
        if due is not None and _reporter is not None:
            _park(_reporter, step, due)
    _last_report = time.monotonic()


Point = tuple[int, float, "float | None", "float | None", "float | None", "float | None", "dict[str, float] | None"]
"""One ``report``: step, wall time, loss, step time, samples per second, gradient norm, other metrics."""
MAX_STEP = 2**62


def _step(step: Any) -> int:
    """``step`` as an int (a numpy or 0-d tensor integer too); a ConfigError naming it otherwise."""
    try:
        whole = operator.index(step) if not isinstance(step, bool) else None
    except TypeError:
        whole = None
    if whole is None or not 0 <= whole <= MAX_STEP:
        raise ConfigError(f"convoy.report: step={step!r} is not a whole number from 0 to 2**62")
    return whole


def _status_point(point: Point) -> tp.StatusPoint:
    step, at, loss, step_time, speed, grad_norm, metrics = point
    return tp.StatusPoint(step=step, time=at, loss=loss, step_time_s=step_time, samples_per_s=speed,
                          grad_norm=grad_norm, metrics=metrics or {})


def _point_tuple(point: tp.StatusPoint) -> Point:
    return (point.step, point.time, point.loss, point.step_time_s, point.samples_per_s, point.grad_norm,
            point.metrics or None)


def _park(reporter: Reporter, step: int, due: tp.VersionInfo) -> None:
    """A restart version is due at the next step: tell the master this rank finished ``step``, then wait for the
    agent to stop this process (the round's restart applies it)."""
    reporter.parked = step
    reporter.flush(SEND_TIMEOUT_S)
    print(f"convoy: rank {reporter.link.task['rank']} finished step {step} and waits for the restart that applies "
          f"config version {due.number}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + PARK_TIMEOUT_S
    live = _live_config()
    while time.monotonic() < deadline and not reporter.refused:
        time.sleep(0.05)
        if live is not None and live.boundary(step) is None:  # the version was reverted: go on
            reporter.parked = None
            return
    reporter.parked = None
    print(f"convoy: no restart came in {PARK_TIMEOUT_S:.0f} s: going on with the config in use",
          file=sys.stderr, flush=True)


def _number(value: Any, name: str) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)  # a tensor of one element too (its .item())
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"convoy.report: {name}={value!r} is not a number") from exc
    return number if math.isfinite(number) or name in ("loss", "grad_norm") else None


_lowest = math.inf
_seen = 0
URGENT_AFTER, URGENT_FACTOR = 20, 2.0
"""A loss above URGENT_FACTOR x the lowest this rank has seen (after URGENT_AFTER reports), or not finite, is sent
at once: the master's divergence rule counts steps, and a batch sent every FLUSH_S holds many."""


def _urgent(loss: float | None) -> bool:
    global _lowest, _seen
    if loss is None:
        return False
    if not math.isfinite(loss):
        return True
    _seen += 1
    urgent = _seen > URGENT_AFTER and loss > URGENT_FACTOR * _lowest > 0
    _lowest = min(_lowest, loss)
    return urgent


def _metrics(given: dict[str, Any]) -> dict[str, float]:
    if len(given) > tp.MAX_METRICS:
        raise ConfigError(f"convoy.report: {len(given)} metrics given; at most {tp.MAX_METRICS} are kept per step")
    long = [name for name in given if len(name) > tp.MAX_METRIC_NAME]
    if long:
        raise ConfigError(f"convoy.report: the metric name {long[0][:80]!r}... is over {tp.MAX_METRIC_NAME} "
                          "characters")
    numbers = {name: _number(value, name) for name, value in given.items()}
    return {name: number for name, number in numbers.items() if number is not None}


def _rss() -> int | None:
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        try:
            return int(os.read(fd, 256).split()[1]) * _PAGE
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return None
