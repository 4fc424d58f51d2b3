"""The agent's side of its fork server (``forkserver.py``): start it, ask it for processes, learn how they end.

``ForkServer.spawn`` returns a ``ForkedProcess``, which answers as much of ``subprocess.Popen`` as the agent
uses (``pid``, ``stdout``, ``poll``, ``wait``, ``returncode``): a process is the server's child, so its exit
status comes from the server, or, while the server has not reaped it (stopped, or slow), from its zombie's entry
in ``/proc``. A reader thread takes the server's messages as they come. A server that leaves a question
unanswered for ``ANSWER_S`` (a fork, a child's exit) is killed; a dead or killed server's processes die with it
(their parent-death signal), each then ended with SIGKILL and the server's fault (``ForkedProcess.fault``): the
agent reports them as an infrastructure fault and starts a fresh server. A dead server is reaped at once by
whoever started it (``launch_server``), not left a zombie until the job ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO, Callable

from convoy import log
from convoy.agent.env import role_spawn_env
from convoy.config import WorkerConfig
from convoy.errors import ConfigError, WorkerStartError
from convoy.procs import die_with_parent, process_running, process_status, signal_name
from convoy.procs import Wakeup

MAX_MESSAGE = 1 << 20
ANSWER_S = 10.0
"""How long the server may leave a question unanswered (a fork, a child's exit to report) before it counts as
hung: it is then killed, with what it forked."""
CLOSE_WAIT_S = 5.0
"""How long a closed server may take to end its processes and exit before it is killed."""
LOOK_S = 0.1
"""How often a process whose exit its server has not reported is looked up in ``/proc`` (the server's report
comes at once; this is for a server that is stopped, hung or dead)."""
KILL_WAIT_S = 5.0
"""How long a wait for a SIGKILLed process may take (one in uninterruptible sleep may take longer: it is then
left to the node's reap)."""


def server_env(host: str, job_id: str, node_id: str) -> dict[str, str]:
    """A node's fork server starts with the environment a role process starts with (settings read at import
    time), tagged with the job and the node, so a scan of ``/proc`` finds what it forked (``reap.py``)."""
    return {**role_spawn_env(host), "CONVOY_JOB_ID": job_id, "CONVOY_NODE_ID": node_id}


def start_fork_server(workers: WorkerConfig, host: str, job_id: str, node_id: str) -> ForkServer | None:
    """Start the node's fork server, preloading ``role_preload`` (None, said on stderr, where it cannot start)."""
    try:
        forks = ForkServer.start(workers.role_preload(), server_env(host, job_id, node_id))
    except OSError as exc:
        log.warning(f"convoy agent {node_id}: cannot start the fork server ({exc}); role processes start on their own")
        return None
    forks.job_id, forks.node_id = job_id, node_id
    return forks


def fork_server_for(forks: ForkServer | None, workers: WorkerConfig, host: str, job_id: str,
                    node_id: str) -> ForkServer | None:
    """This job's fork server: ``forks`` if it was started for the job, else a new one (one started before the
    join for another job id would tag what it forks wrongly)."""
    if forks is not None and forks.job_id == job_id:
        return forks
    if forks is not None:
        forks.close()
    return start_fork_server(workers, host, job_id, node_id)


def launch_server(preload: tuple[str, ...], env: dict[str, str],
                  die_with_us: bool = True) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start a fork server process (it preloads at once); the socket is the end its agent talks to it on. It ends
    with what it forked once the socket's last holder closes it, and, with ``die_with_us``, dies with this process
    (SIGKILL). The launcher starts its agents' servers without: an agent stopping its processes gracefully as the
    launcher dies needs its server alive until the agent itself is done."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "convoy.agent.forkserver", ",".join(preload), str(theirs.fileno())],
            stdin=subprocess.DEVNULL, env=env, start_new_session=True, pass_fds=(theirs.fileno(),),
            preexec_fn=(lambda: die_with_parent(signal.SIGKILL)) if die_with_us else None)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    threading.Thread(target=proc.wait, name="convoy-forkserver-reaper", daemon=True).start()  # reaped as it dies
    return proc, ours


def wait_bounded(proc: subprocess.Popen[bytes] | ForkedProcess, timeout: float) -> int | None:
    """The process's exit code once it has ended, None if it has not within ``timeout``."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def fault_of(proc: subprocess.Popen[bytes] | ForkedProcess) -> str:
    """The infrastructure fault the process died of (its fork server's), "" where it ended of its own."""
    return proc.fault if isinstance(proc, ForkedProcess) else ""


class ForkServer:
    """One fork server of this agent; its calls come from the agent's main loop. The agent started it, or took
    it over from the local launcher (``adopt``), which started it before the agent itself had started."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, sock: socket.socket, job_id: str = "",
                 pid: int = 0, answer_s: float = ANSWER_S) -> None:
        self.proc, self.sock, self.job_id = proc, sock, job_id
        self.node_id = ""
        """The node it serves, for the lines that name it."""
        self.answer_s = answer_s
        self._pid = proc.pid if proc is not None else pid
        self._lock = threading.RLock()
        self._said = Wakeup()  # set as the server says something; the agent's main thread waits on it
        self._ready = self._dead = self._closing = False
        self._fault = ""
        self._answers: dict[int, dict[str, Any]] = {}
        self._reported: dict[int, int] = {}
        """pid -> the exit code the server reported."""
        self._children: dict[int, ForkedProcess] = {}
        """Its processes whose exit it has not reported yet."""
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="convoy-forkserver", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, preload: tuple[str, ...], env: dict[str, str], answer_s: float = ANSWER_S) -> ForkServer:
        """Start the server (it preloads at once); OSError where it cannot start."""
        return cls(*launch_server(preload, env), answer_s=answer_s)

    @classmethod
    def adopt(cls, handle: str, job_id: str) -> ForkServer:
        """The server the launcher started for this agent, from ``--fork-server FD:PID`` (the socket's end, the
        server's pid); a ConfigError naming the flag where the handle is not one."""
        fd, _, pid = handle.partition(":")
        if not (fd.isdigit() and pid.isdigit()):
            raise ConfigError(f"--fork-server {handle!r}: give FD:PID (the launcher passes it)")
        try:
            sock = socket.socket(fileno=int(fd))
        except OSError as exc:
            raise ConfigError(f"--fork-server {handle!r}: file descriptor {fd} is not a socket ({exc})") from exc
        return cls(None, sock, job_id, int(pid))

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def name(self) -> str:
        return f"the fork server of node {self.node_id}" if self.node_id else "the fork server"

    @property
    def preloaded(self) -> bool:
        """Whether it finished preloading (it may have died since)."""
        with self._lock:
            return self._ready

    @property
    def alive(self) -> bool:
        with self._lock:
            return not self._dead and not self._fault

    def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) until the server has preloaded; False if it died or did not make it in time."""
        self._until(lambda: self._ready or self._dead, timeout)
        with self._lock:
            return self._ready and not self._dead

    def spawn(self, env: dict[str, str], argv: list[str], entrypoint: str, module: bool, cgroups: list[str],
              ready_timeout: float, own_pages: bool = True, store: socket.socket | None = None) -> ForkedProcess:
        """Fork one process; WorkerStartError where the server is not there or cannot fork (one that does not
        answer within ``answer_s`` is killed: ``check`` names it). ``own_pages``: it takes its own copy of the
        memory it shares with the server (a limit or a measurement counts it); ``store``: a listening socket the
        process serves the round's store on (``round_store.py``; this end stays the caller's to close)."""
        if not self.wait_ready(ready_timeout):
            raise WorkerStartError("the fork server is not running" if not self.alive else
                                   f"the fork server did not finish preloading in {ready_timeout:.0f} s")
        fault = self.check()
        if fault:
            raise WorkerStartError(fault)
        read_end, write_end = os.pipe()
        with self._lock:
            order_id, self._next_id = self._next_id, self._next_id + 1
        order = {"id": order_id, "env": env, "argv": argv, "entrypoint": entrypoint, "module": module,
                 "cgroups": cgroups, "own_pages": own_pages, "store": store is not None}
        try:
            socket.send_fds(self.sock, [json.dumps(order).encode()],
                            [write_end, *([store.fileno()] if store is not None else [])])
        except OSError as exc:
            os.close(read_end)
            raise WorkerStartError(f"cannot reach the fork server: {exc}") from exc
        finally:
            os.close(write_end)
        answered = self._until(lambda: order_id in self._answers or self._dead, self.answer_s)
        with self._lock:
            answer = self._answers.pop(order_id, None)
        if answer is None:
            os.close(read_end)
            if not answered:
                self.kill(f"{self.name} did not answer in {self.answer_s:.0f} s")
            raise WorkerStartError(self.check() or "the fork server did not answer")
        if "pid" not in answer:
            os.close(read_end)
            raise WorkerStartError(str(answer.get("error")))
        pid, status = int(answer["pid"]), process_status(int(answer["pid"]))
        process = ForkedProcess(self, pid, open(read_end, "rb"),  # noqa: SIM115 (the pump closes it)
                                status.started if status is not None else None)
        with self._lock:
            self._children[pid] = process
        return process

    def returncode_of(self, process: ForkedProcess) -> int | None:
        """The process's exit code (``Popen.returncode``'s form), None while it runs: the server's report, else
        its zombie's status while the server has not reaped it, else SIGKILL once the server died and it is gone
        (``process.fault`` then names the fault)."""
        with self._lock:
            code = self._reported.pop(process.pid, None)
            if code is not None:
                self._children.pop(process.pid, None)  # reported before its spawn had counted it in
                return code
            dead, killed = self._dead, self._fault
        now = time.monotonic()
        if now < process.next_look and not dead:
            return None
        process.next_look = now + LOOK_S
        seen = process_status(process.pid, process.started)
        if seen is not None and seen.state != "Z":
            return None  # running
        if seen is not None and seen.parent == self._pid:  # a zombie its server has not reaped (stopped, or slow)
            self._unanswered(process)
            if killed and seen.code == -signal.SIGKILL:
                process.fault = killed  # killed with its hung server, which has not reaped it yet
            return seen.code  # None where /proc does not show it: the server's report (or its fault) tells
        if seen is None and not dead:  # reaped by the server, whose report is on its way (or never comes)
            self._unanswered(process)
            return None
        # a zombie of another parent, or gone with its server dead: it died with its server
        code = seen.code if seen is not None and seen.code is not None else -signal.SIGKILL
        if code == -signal.SIGKILL:
            process.fault = self._died()
        return code

    def check(self) -> str:
        """The server's fault, "" while it works: it died, or it has left a child's exit unreported for
        ``answer_s`` (stopped, or hung) and is killed here, with what it forked."""
        with self._lock:
            if self._fault or self._closing:
                return self._fault
            dead = self._dead
            since = [child.unreported_since for child in self._children.values() if child.unreported_since is not None]
        if dead:
            return self._died()
        if since and time.monotonic() - min(since) >= self.answer_s:
            self.kill(f"{self.name} did not answer in {self.answer_s:.0f} s")
        with self._lock:
            return self._fault

    def kill(self, why: str) -> None:
        """Kill the server and the process group of each process it forked; ``why`` is its fault from now on."""
        with self._lock:
            self._fault = self._fault or why
            children = list(self._children.values())
        try:
            os.kill(self._pid, signal.SIGKILL)  # a stopped process dies of it too
        except ProcessLookupError:
            pass
        for child in children:
            if process_status(child.pid, child.started) is not None:
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass  # not yet in a session of its own: its parent-death signal ends it

    def close(self) -> None:
        """End the server: it kills the processes it still has, then exits (SIGKILL after a wait)."""
        with self._lock:
            self._closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.proc is not None:
            if wait_bounded(self.proc, CLOSE_WAIT_S) is None:
                self.proc.kill()
                wait_bounded(self.proc, KILL_WAIT_S)
        else:  # the launcher's child: it reaps it; here only the wait (a zombie is gone)
            deadline = time.monotonic() + CLOSE_WAIT_S
            while process_running(self._pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            if process_running(self._pid):
                try:
                    os.kill(self._pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._reader.join(timeout=1.0)
        self.sock.close()
        if not self._reader.is_alive():  # else its last set could write to a reused descriptor
            self._said.close()

    def pause(self, seconds: float) -> None:
        """Sleep until the server says something or ``seconds`` have passed."""
        self._said.wait(seconds)
        self._said.clear()

    def _until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait (bounded) until ``done()`` holds (read under the lock); whether it did. One thread waits at a time."""
        deadline = time.monotonic() + timeout
        while True:
            self._said.clear()  # before the look: what the server says after it wakes the wait below
            with self._lock:
                if done():
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._said.wait(left)

    def _exited(self, pid: int, code: int) -> None:
        """The server reported a process's exit (call with the lock held)."""
        child = self._children.pop(pid, None)
        if child is None or child.returncode is None:  # else known already, from its zombie
            self._reported[pid] = code

    def _unanswered(self, process: ForkedProcess) -> None:
        if process.unreported_since is None:
            process.unreported_since = time.monotonic()

    def _died(self) -> str:
        """The fault of a server that died (not one closed on purpose: its processes were stopped first)."""
        with self._lock:
            if self._fault or self._closing:
                return self._fault
        cause = ""
        if self.proc is not None:  # its own child: its status is known once reaped (by now, or in a moment)
            code = wait_bounded(self.proc, KILL_WAIT_S)
            cause = f" ({signal_name(code)})" if code is not None and code < 0 else \
                f" (exit code {code})" if code is not None else ""
        with self._lock:
            self._fault = self._fault or f"{self.name} died{cause}"
            return self._fault

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
                message = json.loads(data) if data else None
            except (OSError, ValueError):
                message = None
            with self._lock:
                if message is None:
                    self._dead = True
                elif message.get("ready"):
                    self._ready = True
                elif "exited" in message:
                    self._exited(int(message["exited"]), int(message["code"]))
                elif "id" in message:
                    if "pid" in message:
                        self._reported.pop(int(message["pid"]), None)  # of an earlier process with its pid
                    self._answers[int(message["id"])] = message
            self._said.set()
            if message is None:
                return


class ForkedProcess:
    """A process the fork server started, as the agent sees it."""

    def __init__(self, server: ForkServer, pid: int, stdout: BinaryIO, started: int | None = None) -> None:
        self.server, self.pid, self.stdout = server, pid, stdout
        self.started = started
        """Its start time in ``/proc`` (``ProcessStatus.started``; None: it had ended before it was read)."""
        self.returncode: int | None = None
        self.fault = ""
        """Not empty: it died of its server's fault, named here (the server died, or was killed for not
        answering)."""
        self.unreported_since: float | None = None
        """When it was first seen ended without its server's report."""
        self.next_look = time.monotonic() + LOOK_S
        """When ``/proc`` is next read for it."""

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncode_of(self)
        return self.returncode

    def wait(self, timeout: float) -> int:
        """Its exit code; TimeoutExpired after ``timeout`` (there is no unbounded wait)."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
            self.server.pause(0.01)
        assert self.returncode is not None
        return self.returncode
