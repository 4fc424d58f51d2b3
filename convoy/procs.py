"""Process helpers shared by the launcher, the agent and the workers (no torch, no third-party imports),
among them a process tree's memory as ``/proc`` tells it (the agent samples it; a process reads its own)."""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, NamedTuple, NoReturn

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int) -> None:
    """In a child before exec: get ``sig`` when the parent dies (Linux), so nothing is orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def signal_name(returncode: int) -> str | None:
    """``SIGKILL`` for a return code of -9; None for a normal exit."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


class Interrupted(Exception):
    """A signal that stops the command arrived (SIGINT, SIGTERM, ...); ``exit_code`` is the shell's 128 + signal
    number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def raise_interrupted(signum: int, frame: object) -> None:
    """A signal handler that turns SIGINT, SIGTERM (or another stop signal) into ``Interrupted`` in the main thread.

    Only the first signal counts: each is ignored from then on, so a second one (a terminal's Ctrl-C
    followed by the launcher's SIGTERM) cannot break the orderly stop the first began.
    """
    ignore_interrupts()
    raise Interrupted(signum)


def ignore_interrupts() -> None:
    """SIGINT, SIGTERM and every other signal that raises ``Interrupted`` ignored from here on: what follows is a
    bounded stop that must run to its end.

    A command calls it once its outcome is decided (and first thing in its cleanup), so that a signal that
    comes late (the launcher's SIGTERM to a master whose job has just ended) cannot cut the stop short.
    """
    for sig in signal.valid_signals():
        if sig in (signal.SIGINT, signal.SIGTERM) or signal.getsignal(sig) is raise_interrupted:
            signal.signal(sig, signal.SIG_IGN)


def stop_on(signals: Iterable[int]) -> dict[int, Any]:
    """``raise_interrupted`` for each of ``signals`` but one this process was started with ignored: a shell or
    ``nohup`` that ignores a signal (SIGHUP) asks that it not stop the command. Returns the handlers replaced."""
    return {sig: signal.signal(sig, raise_interrupted) for sig in signals if signal.getsignal(sig) != signal.SIG_IGN}


def restore_handlers(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Exit as the interpreter does (threads joined, atexit run, output flushed), minus its teardown.

    Tearing down a process that still holds a gloo process group can abort or deadlock in torch 2.13 (a
    group's destructor joins a gloo thread while holding the GIL that thread needs), so a worker whose work
    is done (results written, peers past their last barrier) ends here; convoy's standbys end the same way.
    """
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    gc.collect()  # the script's objects (open files included) are finalized as usual
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class ProcessStatus(NamedTuple):
    """A process as ``/proc/PID/stat`` shows it."""

    state: str
    parent: int
    started: int
    """Clock ticks from boot to its start: a later process with its pid is not it."""
    code: int | None
    """A zombie's exit code in ``Popen.returncode``'s form (None: still running, or not shown)."""


def process_status(pid: int, started: int | None = None) -> ProcessStatus | None:
    """What ``/proc`` says of a process; None once it is gone, or where its pid is another process's now."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        code = os.waitstatus_to_exitcode(int(fields[49])) if fields[0] == "Z" and len(fields) >= 50 else None
        status = ProcessStatus(fields[0], int(fields[1]), int(fields[19]), code)
    except (OSError, IndexError, ValueError):
        return None
    return status if started is None or status.started == started else None


def process_running(pid: int) -> bool:
    """Whether the process is there and not a zombie (one nobody has reaped yet has ended)."""
    status = process_status(pid)
    return status is not None and status.state != "Z"


_ROLLUP_FIELDS = {"Rss:": "rss", "Pss:": "pss", "Private_Clean:": "private", "Private_Dirty:": "private"}


@dataclass(frozen=True)
class TreeMemory:
    """One sample of a process tree: RSS (shared pages counted in every process that maps them), USS (pages
    only one process maps) and PSS (shared pages split among their mappers), each summed over the tree."""

    rss_bytes: int = 0
    uss_bytes: int = 0
    pss_bytes: int = 0
    num_processes: int = 0


def tree_pids(root_pid: int) -> list[int]:
    """``root_pid`` and all its descendants that are alive now (empty if the root is gone)."""
    if not Path(f"/proc/{root_pid}").exists():
        return []
    found, frontier = [root_pid], [root_pid]
    while frontier:
        pid = frontier.pop()
        for child in _children(pid):
            if child not in found:
                found.append(child)
                frontier.append(child)
    return found


def _children(pid: int) -> list[int]:
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for task in tasks:
        try:
            children += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return children


def process_memory(pid: int) -> TreeMemory:
    """One process's RSS, USS and PSS from ``/proc/PID/smaps_rollup`` (zeros if it is gone)."""
    totals = {"rss": 0, "pss": 0, "private": 0}
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return TreeMemory()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in _ROLLUP_FIELDS:
            totals[_ROLLUP_FIELDS[parts[0]]] += int(parts[1]) * 1024
    return TreeMemory(totals["rss"], totals["private"], totals["pss"], 1)


def sample_tree(root_pid: int) -> TreeMemory:
    """The tree's memory now: each measure summed over ``root_pid`` and its descendants."""
    rss = uss = pss = count = 0
    for pid in tree_pids(root_pid):
        one = process_memory(pid)
        rss, uss, pss, count = rss + one.rss_bytes, uss + one.uss_bytes, pss + one.pss_bytes, count + one.num_processes
    return TreeMemory(rss, uss, pss, count)


class Wakeup:
    """A flag that other threads set and a main thread waits on, safe where a signal handler raises.

    The launcher, the master and the agent turn SIGINT and SIGTERM into ``Interrupted``, raised in the main thread
    wherever it is (``raise_interrupted``). ``threading.Event.wait`` and ``Condition.wait`` are not safe against
    that: the exception can land in the Python code where the wait takes its condition's lock back, so the lock is
    left released and leaving the ``with`` fails with "release unlocked lock" in place of the stop (an agent's
    SIGTERM once ended in that traceback). ``Wakeup.wait`` holds no lock: it polls a pipe, and an exception raised
    while it waits leaves nothing half done. It means what ``threading.Event`` means: ``set`` (from any thread, or
    a signal handler) wakes every waiter until ``clear``.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._read, select.POLLIN)
        self._set = False

    def set(self) -> None:
        # The byte goes before the flag: a byte still in the pipe then means the flag is set (or a clear is under
        # way), so a waiter never finds the pipe readable with nothing to wake it for.
        if self._set:
            return
        try:
            os.write(self._write, b"\0")
        except (BlockingIOError, OSError):  # the pipe is full (a wake is waiting already), or it is closed
            pass
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def clear(self) -> None:
        self._set = False
        try:
            while os.read(self._read, 4096):
                pass
        except (BlockingIOError, OSError):  # drained, or closed
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """Until set or ``timeout`` seconds have passed (None: no bound); whether it is set."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._poll.poll(None if left is None else max(1, int(left * 1000 + 0.999)))
        return self._set

    def close(self) -> None:
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> Wakeup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
