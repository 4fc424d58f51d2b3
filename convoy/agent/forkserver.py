"""The fork server of a job of roles: imports the heavy modules once, then forks each role process from itself.

Why not a warm standby per process, as ordinary workers have: a standby pays ``import torch`` per process (about
2.7 s of CPU), and a node starts several role processes at once (the servers and the chief), then more once the
chief is measured; on 2 cores N concurrent imports take N x 1.35 s, where one import and N forks take one import
(``benchmarks/results/ps_start.txt`` measures both). The agent does not know in advance how many a node will run
either: a fork server serves any number, restarts included.

Run by the agent (or, for a local job, by the launcher, before the agent itself has started: the agent takes
its end of the socket over) as ``python -m convoy.agent.forkserver PRELOAD SOCKET_FD``; it says
``{"ready": true}`` on the socket (SOCK_SEQPACKET, one JSON message per packet) once preloaded. An order is
``{"id", "env", "argv", "entrypoint", "module", "cgroups", "own_pages", "store"}`` with the process's output pipe
as its passed file descriptor (and, with ``store``, a listening socket to serve the round's store on:
``round_store.py``); the answer ``{"id", "pid"}`` (or ``{"id", "error"}``), and
``{"exited": pid, "code": c}`` (``Popen.returncode``'s form) once it ends. A child takes a session of its own,
dies with the server (which ends once the agent's end of the socket closes, and dies with an agent that
started it), joins its cgroups (its memory limit's among them) before anything else, then, where a limit or a
measurement counts its memory (``own_pages``), takes its own copy of the memory it shares with the server
(``inherited.py``: its cgroup and its USS count its imports as if it had made them; about 0.1 s of CPU, which a
process with neither leaves out: its RSS counts the shared pages all the same), takes its thread count from
``OMP_NUM_THREADS``, and runs the script as ``python SCRIPT`` would. When the agent closes the socket, the
server kills the children left and exits.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any, NoReturn

from convoy.agent.inherited import own_inherited_pages
from convoy.agent.round_store import STORE_FD, serve_if_asked
from convoy.agent.standby import keep_process_groups, preload, run_script
from convoy.procs import die_with_parent, exit_without_teardown
from convoy.worker.allocator import set_mmap_threshold

MAX_MESSAGE = 1 << 20


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def main() -> int:
    modules, sock = sys.argv[1], socket.socket(fileno=int(sys.argv[2]))
    preload(modules)
    keep_process_groups()
    gc.freeze()  # the preloaded objects are never collected: the children's collections do not touch them
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_write)
    try:
        send(sock, {"ready": True, "pid": os.getpid()})
    except OSError:  # its launcher or agent was gone before it had preloaded (a refused join): nothing to serve
        return 0
    children: set[int] = set()
    try:
        while True:
            readable = select.select([sock, wake_read], [], [])[0]
            if wake_read in readable:
                while _drain(wake_read):
                    pass
            _reap(sock, children)
            if sock in readable:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
                except ConnectionError:
                    return 0  # the agent is gone
                if not data:
                    return 0  # the agent is done (or gone)
                _fork(sock, json.loads(data), fds, children, (wake_read, wake_write))
    finally:
        for pid in children:
            _kill_group(pid)
        for pid in children:
            _wait(pid)


def _fork(sock: socket.socket, order: dict[str, Any], fds: list[int], children: set[int],
          own_fds: tuple[int, int]) -> None:
    server = os.getpid()
    try:
        output = fds[0]
        pid = os.fork()
    except (IndexError, OSError) as exc:
        for fd in fds:
            os.close(fd)
        send(sock, {"id": order.get("id"), "error": f"cannot fork the process: {exc}"})
        return
    if pid == 0:
        if order.get("store") and len(fds) > 1:
            order["env"][STORE_FD] = str(fds[1])  # the round's store, served on this listening socket
        _become(order, output, server, [sock.fileno(), *own_fds])
    for fd in fds:
        os.close(fd)
    children.add(pid)
    send(sock, {"id": order["id"], "pid": pid})


def _become(order: dict[str, Any], output: int, server: int, server_fds: list[int]) -> NoReturn:
    """The child: becomes the role process; never returns into the server's loop."""
    try:
        os.setsid()
        die_with_parent(signal.SIGKILL)
        if os.getppid() != server:
            os._exit(1)  # the server died before the child could follow it
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for path in order.get("cgroups", []):
            _join(path)
        try:
            if order.get("own_pages", True):
                own_inherited_pages()
        except OSError as exc:
            print(f"convoy: this process's memory shared with the fork server stays charged to it: {exc}",
                  file=sys.stderr, flush=True)
        os.environ.clear()
        os.environ.update(order["env"])
        sys.argv = list(order["argv"])
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()  # a fresh process seeds numpy's global generator afresh (``random`` reseeds itself)
        _take_threads(os.environ.get("OMP_NUM_THREADS", ""))
        _take_mmap_threshold(os.environ.get("MALLOC_MMAP_THRESHOLD_", ""))
        serve_if_asked()
        code = run_script(str(order["entrypoint"]), bool(order["module"]))
    except BaseException:  # noqa: BLE001 (a child must end here, whatever happened)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    exit_without_teardown(code)


def _take_threads(value: str) -> None:
    """Torch's thread count as a fresh process would take it from ``OMP_NUM_THREADS``: the OpenMP runtime read
    the server's environment when torch was imported, so a child's own value is set by hand."""
    torch = sys.modules.get("torch")
    if torch is not None and value.strip().isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


def _take_mmap_threshold(value: str) -> None:
    """glibc's mmap threshold as a fresh process would take it from ``MALLOC_MMAP_THRESHOLD_``: the server's
    malloc read the server's environment at its start, so a child's own value is set by hand."""
    if value.strip().isdigit():
        set_mmap_threshold(int(value))


def _join(path: str) -> None:
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as procs:
            procs.write(f"{os.getpid()}\n")
    except OSError as exc:
        print(f"convoy: cannot join the cgroup {path}: {exc.strerror or exc}", file=sys.stderr, flush=True)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        try:
            send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        except OSError:
            pass  # the agent is gone; the loop ends at the socket's end


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


if __name__ == "__main__":
    sys.exit(main())
