"""The agent's side of its fork server (``forkserver.py``): start it, ask it for processes, learn how they end.

``ForkServer.spawn`` returns a ``ForkedProcess``, which answers as much of ``subprocess.Popen`` as the agent
uses (``pid``, ``stdout``, ``poll``, ``wait``, ``returncode``): a process is the server's child, so its exit
status comes from the server. A reader thread takes the server's messages as they come. Should the server die,
its processes die with it (their parent-death signal), and each is reported killed by SIGKILL once gone.
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
from typing import Any, BinaryIO

from convoy import log
from convoy.agent.env import STEADY_MALLOC, spawn_env
from convoy.config import WorkerConfig
from convoy.errors import ConfigError, WorkerStartError
from convoy.procs import die_with_parent

MAX_MESSAGE = 1 << 20
SPAWN_TIMEOUT_S = 30.0
"""How long a fork may take once the server is ready."""
CLOSE_WAIT_S = 5.0


def server_env(host: str, job_id: str, node_id: str) -> dict[str, str]:
    """A node's fork server starts with the environment a role process starts with (settings read at import
    time), tagged with the job and the node, so a scan of ``/proc`` finds what it forked (``reap.py``)."""
    return {**STEADY_MALLOC, **spawn_env(1, host=host), "CONVOY_JOB_ID": job_id, "CONVOY_NODE_ID": node_id}


def start_fork_server(workers: WorkerConfig, host: str, job_id: str, node_id: str) -> ForkServer | None:
    """Start the node's fork server, preloading ``WorkerConfig.role_preload`` (None, said on stderr, where it cannot
    start)."""
    try:
        forks = ForkServer.start(workers.role_preload(), server_env(host, job_id, node_id))
    except OSError as exc:
        log.warning(f"convoy agent {node_id}: cannot start the fork server ({exc}); role processes start on their own")
        return None
    forks.job_id = job_id
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
    return proc, ours


class ForkServer:
    """One fork server of this agent; its calls come from the agent's main loop. The agent started it, or took
    it over from the local launcher (``adopt``), which started it before the agent itself had started."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, sock: socket.socket, job_id: str = "",
                 pid: int = 0) -> None:
        self.proc, self.sock, self.job_id = proc, sock, job_id
        self._pid = proc.pid if proc is not None else pid
        self._lock = threading.Condition()
        self._ready = False
        self._dead = False
        self._answers: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="convoy-forkserver", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, preload: tuple[str, ...], env: dict[str, str]) -> ForkServer:
        """Start the server (it preloads at once); OSError where it cannot start."""
        return cls(*launch_server(preload, env))

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
    def alive(self) -> bool:
        with self._lock:
            return not self._dead

    def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) until the server has preloaded; False if it died or did not make it in time."""
        with self._lock:
            self._lock.wait_for(lambda: self._ready or self._dead, timeout)
            return self._ready and not self._dead

    def spawn(self, env: dict[str, str], argv: list[str], entrypoint: str, module: bool, cgroups: list[str],
              ready_timeout: float, own_pages: bool = True, store: socket.socket | None = None) -> ForkedProcess:
        """Fork one process; WorkerStartError where the server is not there or cannot fork. ``own_pages``: it
        takes its own copy of the memory it shares with the server (a limit or a measurement counts it);
        ``store``: a listening socket the process serves the round's store on (``round_store.py``; this end
        stays the caller's to close)."""
        if not self.wait_ready(ready_timeout):
            raise WorkerStartError("the fork server is not running" if not self.alive else
                                   f"the fork server did not finish preloading in {ready_timeout:.0f} s")
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
        with self._lock:
            self._lock.wait_for(lambda: order_id in self._answers or self._dead, SPAWN_TIMEOUT_S)
            answer = self._answers.pop(order_id, {"error": "the fork server did not answer"})
        if "pid" not in answer:
            os.close(read_end)
            raise WorkerStartError(str(answer.get("error")))
        return ForkedProcess(self, int(answer["pid"]), open(read_end, "rb"))  # noqa: SIM115 (the pump closes it)

    def exit_code(self, pid: int) -> int | None:
        """The process's exit code (``Popen.returncode``'s form), None while it runs."""
        with self._lock:
            code = self._exits.get(pid)
            dead = self._dead
        if code is None and dead and not _exists(pid):
            return -signal.SIGKILL  # it died with the server, which could not report it
        return code

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.exit_code(pid)) is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            with self._lock:
                self._lock.wait(0.01)
        return code

    def close(self) -> None:
        """End the server: it kills the processes it still has, then exits (SIGKILL after a wait)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        else:  # the launcher's child: it reaps it; here only the wait (a zombie is gone)
            deadline = time.monotonic() + CLOSE_WAIT_S
            while _exists(self._pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            if _exists(self._pid):
                try:
                    os.kill(self._pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._reader.join(timeout=1.0)
        self.sock.close()

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
                    self._exits[int(message["exited"])] = int(message["code"])
                elif "id" in message:
                    self._answers[int(message["id"])] = message
                self._lock.notify_all()
            if message is None:
                return


class ForkedProcess:
    """A process the fork server started, as the agent sees it."""

    def __init__(self, server: ForkServer, pid: int, stdout: BinaryIO) -> None:
        self.server, self.pid, self.stdout = server, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.wait_exit(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
        return self.returncode


def _exists(pid: int) -> bool:
    """Whether the process is there and not a zombie (one nobody has reaped yet has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False
