"""The platform host: starts the enclave process, relays requests to it, and stops it.

The host is the untrusted operator: it sees frame sizes and the clear headers (party, round, sequence
number), never rows or models. It starts the enclave under ``unshare -n`` (a fresh network namespace
with only a down loopback) where that is permitted, and otherwise says it could not; the enclave's one
channel is a socketpair end passed as an inherited file descriptor.
"""

from __future__ import annotations

import functools
import shutil
import signal
import socket
import subprocess
import sys
from types import TracebackType
from typing import Any

from convoy.errors import ConfigError
from convoy.procs import die_with_parent
from convoy.workloads.confidential.attestation import SimulatedRootOfTrust
from convoy.workloads.confidential.config import EnclaveConfig
from convoy.workloads.confidential.errors import ERROR_TYPES, ConfidentialError, EnclaveError
from convoy.workloads.confidential.wire import recv_frame_sized, send_frame, send_raw_frame

ISOLATED = "network namespace (unshare -n): no network but its channel to the host"
NOT_ISOLATED = "NOT network-isolated: unshare -n is not permitted here, the enclave shares the host's network"


@functools.lru_cache(maxsize=1)
def unshare_permitted() -> bool:
    """Whether ``unshare -n`` works for this user here (it needs root or user namespaces)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _child_setup() -> None:
    die_with_parent(signal.SIGKILL)  # the enclave never outlives its host


class EnclaveHost:
    """One enclave process and the host's end of its channel; use as a context manager so it always stops."""

    def __init__(self, config: EnclaveConfig, root: SimulatedRootOfTrust | None = None, isolate: bool = True,
                 reply_timeout_s: float = 300.0) -> None:
        config.validate()
        if config.backend == "simulated" and not config.plaintext_baseline and root is None:
            raise ConfigError("the simulated backend needs a SimulatedRootOfTrust to stand in for the hardware key")
        self.config, self.root, self.reply_timeout_s = config, root, reply_timeout_s
        self.isolation = ISOLATED if isolate and unshare_permitted() else NOT_ISOLATED
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.info: dict[str, Any] = {}
        self.frames: list[tuple[str, str, int]] = []
        """What the host saw: (direction, op, bytes) for every frame it relayed."""

    def start(self) -> dict[str, Any]:
        """Start the enclave and send it its configuration; returns what it said about itself."""
        host_end, enclave_end = socket.socketpair()
        command = [sys.executable, "-m", "convoy.workloads.confidential.enclave", "--fd", str(enclave_end.fileno())]
        if self.isolation == ISOLATED:
            command = ["unshare", "-n", "--", *command]
        try:
            self.proc = subprocess.Popen(command, pass_fds=(enclave_end.fileno(),), stdin=subprocess.DEVNULL,
                                         preexec_fn=_child_setup)
        except OSError as exc:
            host_end.close()
            raise EnclaveError(f"could not start the enclave process ({exc})") from exc
        finally:
            enclave_end.close()
        self.sock = host_end
        self.sock.settimeout(self.reply_timeout_s)
        init: dict[str, Any] = {"op": "init", "config": self.config.to_json()}
        if self.root is not None:
            init.update(root_key=self.root.private_bytes.hex(), root_public=self.root.public_bytes.hex())
        try:
            self.info = self.call_raw(init)
        except BaseException:
            self.stop()
            raise
        if not self.info.get("ok"):
            self.stop()
            raise ERROR_TYPES.get(self.info.get("error_type", ""), EnclaveError)(self.info.get("error", ""))
        return self.info

    def call_raw(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return the enclave's reply as it is (``ok`` false included)."""
        sock = self._channel()
        size = send_frame(sock, message)
        self.frames.append(("to-enclave", str(message.get("op")), size))
        return self._reply(str(message.get("op")))

    def send_raw(self, body: bytes) -> dict[str, Any]:
        """Send arbitrary bytes as one frame (what a broken or hostile client would) and return the reply."""
        send_raw_frame(self._channel(), body)
        self.frames.append(("to-enclave", "raw", len(body) + 4))
        return self._reply("raw")

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send ``op`` and return the reply; a refusal raises the enclave's error class with its message."""
        reply = self.call_raw({"op": op, **fields})
        if not reply.get("ok"):
            raise ERROR_TYPES.get(reply.get("error_type", ""), EnclaveError)(reply.get("error", "refused"))
        return reply

    def _channel(self) -> socket.socket:
        if self.sock is None:
            raise EnclaveError("the enclave is not running; start it first")
        return self.sock

    def _reply(self, op: str) -> dict[str, Any]:
        try:
            reply, size = recv_frame_sized(self._channel())
        except TimeoutError as exc:
            raise EnclaveError(f"the enclave did not answer {op!r} within {self.reply_timeout_s:.0f} s") from exc
        if reply is None:
            try:
                code = self.proc.wait(5) if self.proc is not None else None
            except subprocess.TimeoutExpired:
                code = None
            raise EnclaveError(f"the enclave closed its channel while handling {op!r} (exit code {code})")
        self.frames.append(("to-host", op, size))
        return reply

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Ask the enclave to shut down, then terminate or kill it; returns its exit code."""
        if self.sock is not None and self.alive():
            try:
                self.sock.settimeout(timeout_s)
                send_frame(self.sock, {"op": "shutdown"})
                recv_frame_sized(self.sock)  # its answer: it has stopped serving
            except (OSError, ConfidentialError):
                pass
        if self.sock is not None:
            self.sock.close()  # EOF on its channel also ends the enclave
            self.sock = None
        if self.proc is None:
            return None
        for action in (None, self.proc.terminate, self.proc.kill):
            if action is not None:
                action()
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()

    def __enter__(self) -> EnclaveHost:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
