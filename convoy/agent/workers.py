"""Worker processes of one node: warm standbys, log pumps, start, poll, and stop."""

from __future__ import annotations

import collections
import errno
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from convoy.agent.env import spawn_env, worker_env
from convoy.agent.reap import NodeCgroup
from convoy.worker_events import MARK, parse
from convoy.config import WorkerConfig
from convoy.errors import WorkerStartError
from convoy.procs import die_with_parent

if TYPE_CHECKING:
    from convoy.control.protocol import MemberInfo, RoundInfo

TAIL_LINES = 20
HELD_LINES = 1000
"""Lines kept from a standby that has no rank yet; older ones are dropped."""
LOG_REOPEN_S = 1.0
"""How often a log file that could not be opened is tried again."""
REFILL_DELAY_S = 5.0


PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "connectfullmesh",
             "connection refused", "socket timeout", "ncclremoteerror", "nccl communicator was aborted",
             "gloo/transport", "read error")
"""What a worker's last lines say when it failed because a peer was gone (lowercase)."""
TRACE_LINES = 400
TRACE_START = b"Traceback (most recent call last):"


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
    A line that records an event (``convoy.worker_events``) is also put on ``events`` as
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


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    pump: LogPump
    ready_fd: int
    """Read end of a pipe the standby writes to once its preloading is done."""
    local_rank: int = -1
    rank: int = -1
    _ready: bool = False

    def preloaded(self) -> bool:
        """True once the standby has imported its preload modules (or has died)."""
        if not self._ready and select.select([self.ready_fd], [], [], 0)[0]:
            self._ready = True
            os.close(self.ready_fd)
        return self._ready

    def release(self) -> None:
        if not self._ready:
            self._ready = True
            os.close(self.ready_fd)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class WorkerGroup:
    """The local workers of one node. Keeps ``nproc`` warm standbys ready for the next round."""

    def __init__(self, config: WorkerConfig, run_dir: Path, console: BinaryIO | None = None,
                 host: str | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self._env = spawn_env(config.nproc_per_node, host=host)
        self._console = console or sys.stdout.buffer
        self._console_lock = threading.Lock()
        self._standbys: list[Worker] = []
        self.workers: list[Worker] = []
        self._started_at = 0.0
        self.lease_file = ""
        """The node's round lease (``CONVOY_LEASE`` for the workers), once the agent has made it."""
        self.agent_env: dict[str, str] = {}
        """How the workers reach the agent's local API (``CONVOY_AGENT_URL``, ``CONVOY_AGENT_TOKEN``)."""
        self.cgroup: NodeCgroup | None = None
        """Where this node's workers and all they start are kept, where a cgroup hierarchy is writable."""
        self.events: queue.SimpleQueue[tuple[int, str, str]] = queue.SimpleQueue()
        """Events the workers recorded, ``(rank, kind, message)``, for the agent to send on."""
        self.failures = Failures()
        """The first failure of the running round (the workers failing after it get a line each)."""

    def fill_standbys(self) -> None:
        """Start standbys until there is one per local worker (call from the main thread)."""
        while len(self._standbys) < self.config.nproc_per_node:
            try:
                self._standbys.append(self._spawn())
            except OSError as exc:
                raise WorkerStartError(f"cannot start a worker process ({sys.executable}): {exc}") from exc

    def wait_preloaded(self, timeout: float) -> bool:
        """Start standbys if needed and wait (bounded) until all have imported their preload list."""
        self.fill_standbys()
        deadline = time.monotonic() + timeout
        while not all(standby.preloaded() for standby in self._standbys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def refill_when_idle(self, now: bool = False) -> None:
        """Warm the next round's standbys once this round's workers are done importing and have run
        ``REFILL_DELAY_S``, so the imports do not compete with the workers' start and first steps; ``now``: a
        restart of the training config is coming, and the next round needs them sooner."""
        settled = now or time.monotonic() - self._started_at >= REFILL_DELAY_S
        if settled and len(self._standbys) < self.config.nproc_per_node and all(w.preloaded() for w in self.workers):
            self.fill_standbys()

    def _spawn(self) -> Worker:
        ready_read, ready_write = os.pipe()
        command = [sys.executable, "-m", "convoy.agent.standby", ",".join(self.config.preload), str(ready_write)]
        try:
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self._env,
                start_new_session=True, pass_fds=(ready_write,), preexec_fn=lambda: die_with_parent(signal.SIGKILL),
            )
        except BaseException:
            os.close(ready_read)
            raise
        finally:
            os.close(ready_write)
        if self.cgroup is not None:
            self.cgroup.add(proc.pid)
        assert proc.stdout is not None
        pump = LogPump(proc.stdout, self._console, self._console_lock, self.events,  # type: ignore[arg-type]
                       self.failures)
        pump.start()
        return Worker(proc, pump, ready_read)

    def use_cgroup(self, cgroup: NodeCgroup) -> None:
        """Keep every worker, the standbys already started included, in ``cgroup`` from now on."""
        self.cgroup = cgroup
        for worker in [*self._standbys, *self.workers]:
            cgroup.add(worker.proc.pid)

    def start(self, round_info: RoundInfo, member: MemberInfo, master_url: str) -> None:
        """Hand each standby its rank for this round, then warm new standbys for the next one."""
        self.fill_standbys()
        self._started_at = time.monotonic()
        self.failures.reset()
        self.workers, self._standbys = self._standbys[: member.nproc], self._standbys[member.nproc :]
        logs = Path(self.config.log_dir) if self.config.log_dir else self.run_dir / "logs"
        log_dir = logs / f"round{round_info.round_id}"
        for local_rank, worker in enumerate(self.workers):
            worker.local_rank, worker.rank = local_rank, member.rank_offset + local_rank
            log_file = log_dir / f"rank{worker.rank}.log"
            worker.pump.assign(worker.rank, log_file, show=self.config.shows_console(local_rank))
            env = worker_env(round_info, member, local_rank, str(self.run_dir), master_url, str(log_file),
                             self.config.role_name)
            if self.lease_file:
                env["CONVOY_LEASE"] = self.lease_file
            env.update(self.agent_env)
            order = {"env": env, "argv": self._argv(), "entrypoint": self.config.entrypoint,
                     "module": self.config.module, "no_python": self.config.no_python}
            try:
                assert worker.proc.stdin is not None
                worker.proc.stdin.write(json.dumps(order).encode() + b"\n")
                worker.proc.stdin.close()
            except BrokenPipeError:
                pass  # the standby died before its order arrived; poll() reports its exit

    def _argv(self) -> list[str]:
        first = self.config.entrypoint if not self.config.module or self.config.no_python else \
            f"-m {self.config.entrypoint}"
        return [first, *self.config.args]

    def poll(self) -> tuple[list[Worker], list[Worker]]:
        """Return (finished with 0, failed) among this round's workers."""
        done = [w for w in self.workers if w.returncode == 0]
        failed = [w for w in self.workers if w.returncode not in (None, 0)]
        return done, failed

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM this round's workers (each its own process group), SIGKILL after the grace period."""
        grace = self.config.stop_grace_s if grace_s is None else grace_s
        alive = [w for w in self.workers if w.returncode is None]
        for worker in alive:
            worker.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            time.sleep(0.01)
            alive = [w for w in alive if w.returncode is None]
        for worker in self.workers:
            worker.signal(signal.SIGKILL)  # also reaches children a finished worker left behind
            worker.proc.wait()
            worker.pump.join(timeout=2.0)
            worker.release()
        self.workers = []

    def close(self) -> None:
        """Stop everything this group started, standbys included."""
        self.stop()
        for standby in self._standbys:
            standby.signal(signal.SIGKILL)
            standby.proc.wait()
            standby.release()
        self._standbys = []
