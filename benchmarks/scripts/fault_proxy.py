"""A loopback HTTP proxy between one agent and the master, for the lost-join-reply fault.

It passes every request and reply through unchanged until ``arm()``; then the next ``POST /v1/join``
goes to the master as usual, the master's reply is read in full and dropped (the agent's connection
is closed unanswered, as when a reply is lost on the way), and everything passes through again. The
agent's client must retry; whether the master handles the retry as the same join is what is measured.
``ProxiedJob`` runs ``convoy master`` and two agents on loopback, one of them behind the proxy.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from fault_job import Job, read_state

from convoy.ports import free_port

JOIN_PATH = b"/v1/join"
HEAD_LIMIT = 64 * 1024


class ReplyLost(Exception):
    """The proxy dropped this reply on purpose."""


def _read_head(sock: socket.socket, buffered: bytes) -> tuple[bytes, bytes] | None:
    """(head up to and with the blank line, bytes after it); None when the peer closed first."""
    data = buffered
    while b"\r\n\r\n" not in data:
        if len(data) > HEAD_LIMIT:
            raise OSError("HTTP head too long")
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    end = data.index(b"\r\n\r\n") + 4
    return data[:end], data[end:]


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return None


def _read_body(sock: socket.socket, rest: bytes, length: int | None) -> tuple[bytes, bytes]:
    """(body, bytes after it): ``length`` bytes, or everything until the peer closes when it is unknown."""
    data = rest
    while length is None or len(data) < length:
        chunk = sock.recv(65536)
        if not chunk:
            if length is None:
                break
            raise OSError("peer closed inside a body")
        data += chunk
    if length is None:
        return data, b""
    return data[:length], data[length:]


class ReplyDropper:
    """Listens on 127.0.0.1 (``port``) and forwards to the master at ``upstream``; drops one join reply once armed."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self._armed = threading.Event()
        self._closed = threading.Event()
        self.dropped_at: list[float] = []
        """Wall times of the replies dropped (one at most)."""
        self.joins = 0
        """``POST /v1/join`` requests seen (retries included)."""
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    def arm(self) -> None:
        """Drop the reply to the next join."""
        self._armed.set()

    def close(self) -> None:
        self._closed.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), name="fault-proxy-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        """One agent connection, request by request over one connection to the master."""
        upstream = socket.create_connection(self.upstream)
        from_client, from_master = b"", b""
        try:
            while not self._closed.is_set():
                request = _read_head(client, from_client)
                if request is None:
                    return
                head, rest = request
                body, from_client = _read_body(client, rest, _content_length(head) or 0)
                is_join = head.startswith(b"POST " + JOIN_PATH + b" ")
                self.joins += is_join
                upstream.sendall(head + body)
                reply = _read_head(upstream, from_master)
                if reply is None:
                    return
                reply_head, reply_rest = reply
                reply_body, from_master = _read_body(upstream, reply_rest, _content_length(reply_head))
                if is_join and self._armed.is_set():
                    self._armed.clear()
                    self.dropped_at.append(time.time())
                    raise ReplyLost
                client.sendall(reply_head + reply_body)
        except (OSError, ValueError, ReplyLost):
            return
        finally:
            client.close()
            upstream.close()


class ProxiedJob(Job):
    """``convoy master`` and two ``convoy agent``s on loopback; agent ``proxied`` talks to the master through
    a ``ReplyDropper`` (``proxy``). The master's exit is the job's."""

    def __init__(self, tmp: Path, sleep_s: float, seed: int, proxied: int) -> None:
        super().__init__(tmp, nodes=2)
        self.proxied_node = f"split{proxied}"
        self.agent_procs: list[subprocess.Popen[bytes]] = []
        self.proxy: ReplyDropper | None = None
        try:
            self._start(sleep_s, seed, proxied)
        except BaseException:
            self.stop()
            raise

    def _start(self, sleep_s: float, seed: int, proxied: int) -> None:
        python = [sys.executable, "-m", "convoy"]
        port = free_port()
        self.main = self.spawn([*python, "master", "--host", "127.0.0.1", "--port", str(port), "--nnodes", "2",
                                "--max-restarts", "5", "--run-dir", str(self.run_dir)])
        deadline = time.monotonic() + 30
        while not (self.run_dir / "token").exists() or read_state(self.run_dir) is None:
            if time.monotonic() > deadline or self.main.poll() is not None:
                raise RuntimeError(f"the master did not start: {self.last_error()}")
            time.sleep(0.05)
        self.proxy = ReplyDropper("127.0.0.1", port)
        for index in range(2):
            target = self.proxy.port if index == proxied else port
            self.agent_procs.append(self.spawn([
                *python, "agent", "--master", f"127.0.0.1:{target}", "--token-file", str(self.run_dir / "token"),
                "--run-dir", str(self.run_dir), "--node-id", f"split{index}", "--nproc-per-node", "1",
                "--stop-grace", "2", *self.train_args(sleep_s, seed)]))

    def agents(self) -> list[psutil.Process]:
        return [self.known[p.pid] for p in self.agent_procs if p.poll() is None]

    def stop(self, grace_s: float = 10.0) -> None:
        try:
            super().stop(grace_s)
        finally:
            if self.proxy is not None:
                self.proxy.close()
