"""The lease watcher: a process whose round lease has expired stops itself, whatever its main thread is doing.

The round fence (``runtime/fence.py``) keeps a stale worker from committing convoy's state; the watcher keeps it
from doing anything else: training on, pushing to a service, writing metrics or the user's own files. Every
process a convoy agent starts under a lease (``CONVOY_LEASE``) runs one from where its code begins
(``agent/standby.py``'s ``run_script``, which the fork server's children run too): a daemon thread that reads the
lease at its expiry and at least every ``POLL_S``. Once the lease has expired (a whole heartbeat timeout with no
answer from the master: the agent is stopped or cut off, and the master may have given this node's work to
others) it says one line on stderr, SIGKILLs what the process started in its process group (as the agent's stop
would) and ends the process with ``os._exit``: no handler, atexit or finaliser runs, and a collective the main
thread waits in, or a snapshot copy in flight, ends with it as under SIGKILL, which both survive already. A
process with no lease (plain python, torchrun) runs none. Torch-free.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Mapping

from convoy.procs import die_with_parent
from convoy.worker.lease import LEASE_ENV, Lease, lease_clock, own_round, read_lease

EXIT_CODE = 75
"""How a process that stopped for an expired lease exits (EX_TEMPFAIL: its work is to be done again elsewhere)."""
POLL_S = 1.0
"""The longest the watcher sleeps between two reads of the lease (it also wakes at the expiry it last read)."""
SAY_BOUND_S = 1.0
"""How long the last line may take to leave: a pipe that a stopped agent no longer reads may be full."""


def next_read_in(lease: Lease | None, round_id: int | None, now: float) -> float | None:
    """Seconds until the lease is to be read again: 0 once it has expired; None when there is nothing to watch
    (no lease, or its round ended: the agent that ended it stops this process itself)."""
    if lease is None or not lease.of(round_id):
        return None
    if lease.expired(round_id, now):
        return 0.0
    return min(lease.expires_at - now, POLL_S)


def expiry_line(lease: Lease, round_id: int | None, now: float, pid: int, how: str) -> str:
    """The one line a process stopped for an expired lease leaves."""
    which = f"round {round_id}'s lease" if round_id is not None else "the job's lease"
    return (f"convoy: {which} expired {now - lease.expires_at:.1f} s ago (this node's agent has heard nothing from "
            f"the master for a whole heartbeat timeout: it is stopped or cut off, and the master may have given "
            f"this node's work to others): stopping process {pid} now ({how})")


class LeaseWatch:
    """Watches one lease file for a process of ``round_id`` (None: any current round); calls ``on_expiry`` with
    the line to say once the lease has expired."""

    def __init__(self, lease_file: str, round_id: int | None, on_expiry: Callable[[str], None],
                 pid: int | None = None, how: str = f"exit code {EXIT_CODE}") -> None:
        self.lease_file, self.round_id, self.on_expiry = lease_file, round_id, on_expiry
        self.pid, self.how = pid if pid is not None else os.getpid(), how
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="convoy-lease-watch", daemon=True)

    def start(self) -> LeaseWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        """Watch no more (the thread ends within a read)."""
        self._stopping.set()

    def run(self) -> None:
        while not self._stopping.is_set():
            lease = read_lease(self.lease_file)
            now = lease_clock()
            wait = next_read_in(lease, self.round_id, now)
            if wait is None:
                return
            if wait <= 0.0:
                assert lease is not None
                self.on_expiry(expiry_line(lease, self.round_id, now, self.pid, self.how))
                return
            self._stopping.wait(wait)


def watch_lease(environ: Mapping[str, str] = os.environ) -> LeaseWatch | None:
    """Start this process's watcher where a convoy agent gave it a lease; None elsewhere."""
    path = environ.get(LEASE_ENV)
    if not path:
        return None
    return LeaseWatch(path, own_round(environ), stop_this_process).start()


def watch_from_child(environ: Mapping[str, str] = os.environ) -> int | None:
    """For a process about to exec another program (``--no-python``), which no thread of ours survives: a forked
    child watches the lease and SIGKILLs the program's process group once the lease has expired, and dies with it
    otherwise. The child's pid (None without a lease)."""
    path = environ.get(LEASE_ENV)
    if not path:
        return None
    watched = os.getpid()
    child = os.fork()
    if child:
        return child
    try:
        die_with_parent(signal.SIGKILL)
        _name_this_process(b"convoy-lease")  # in ps, not a second copy of the standby
        if os.getppid() == watched:  # else it is gone already
            LeaseWatch(path, own_round(environ), lambda line: _say_then(line, lambda: _kill_group_of(watched)),
                       pid=watched, how="SIGKILL").run()
            while True:  # nothing left to watch: wait for the end of the program (or its group's stop), not as a
                signal.pause()  # zombie that a program which reaps no children would keep
    finally:
        os._exit(0)


def _name_this_process(name: bytes) -> None:
    try:
        with open("/proc/self/comm", "wb") as comm:
            comm.write(name)
    except OSError:
        pass  # a name is a courtesy


def stop_this_process(line: str) -> None:
    """Say ``line`` on stderr (bounded), then end this process at once, with what it started in its process group
    (as the agent's stop would: a worker leads a group of its own)."""
    _say_then(line, _kill_rest_of_group)
    os._exit(EXIT_CODE)


def _kill_rest_of_group() -> None:
    """SIGKILL the other members of the process group this process leads (none where it leads none)."""
    me = os.getpid()
    if os.getpgrp() != me:
        return
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.getpgid(int(entry)) == me:
                os.kill(int(entry), signal.SIGKILL)
        except OSError:
            continue  # gone meanwhile


def _kill_group_of(pid: int) -> None:
    """SIGKILL ``pid`` and the process group it leads (this watcher among them)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass  # gone already


def _say_then(line: str, act: Callable[[], None]) -> None:
    """Write ``line`` to fd 2 from a helper thread (a full pipe must not hold the stop up), then ``act``."""
    data = (line + "\n").encode(errors="replace")
    writer = threading.Thread(target=_write_all, args=(2, data), name="convoy-lease-say", daemon=True)
    writer.start()
    writer.join(SAY_BOUND_S)
    act()


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass  # no stderr to say it on: the process stops all the same
