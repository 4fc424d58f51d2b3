"""The Ray actor that holds one node's share of a job and runs its ``convoy agent`` there.

The actor is the share's holder (Ray counts its CPUs, GPUs and memory as taken while it lives); the agent is an
ordinary ``convoy agent`` process, its child, that ends when the actor's process ends (the actor killed, its raylet
lost) and stops its workers in turn. The actor is detached: a driver that was killed leaves the job training (its
agents wait ``master_timeout_s`` for a master), and ``convoy run --resume`` takes it back; the actor ends itself
shortly after its agent does. The token reaches the node in the call,
not through a shared file, and is written there readable by this user only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from convoy.procs import die_with_parent

LINGER_S = 10.0
"""How long the actor outlives its agent: the driver reads the exit code and ends the actor well within it; where the
driver was killed, the actor then ends itself (detached, nothing else would), giving its share back."""


class NodeAgent:
    """One per Ray node of the job (``ray.remote`` wraps it where the scheduler starts it)."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self.process: subprocess.Popen[bytes] | None = None
        self.folder = Path(tempfile.mkdtemp(prefix="convoy-ray-agent-"))
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        """How Ray prefixes the lines of this node's agent and workers on the driver's console."""
        return f"convoy agent {self.node_name}"

    def start(self, agent_args: list[str], token: str, cwd: str) -> int:
        """Start ``convoy agent --token-file F AGENT_ARGS`` (F: the token, written here) in ``cwd`` (the driver's
        directory, where the node has it; else the actor's); its pid."""
        token_file = self.folder / "token"
        descriptor = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(token)
        with self._lock:
            if self.process is not None:
                raise RuntimeError("this node's agent was started already")
            self.process = subprocess.Popen(  # a thread of the actor starts it: SIGTERM when the actor's process ends
                [sys.executable, "-m", "convoy", "agent", "--token-file", str(token_file), *agent_args],
                preexec_fn=lambda: die_with_parent(signal.SIGTERM), stdin=subprocess.DEVNULL,
                cwd=cwd if os.path.isdir(cwd) else None)
            threading.Thread(target=self._end_after_agent, args=(self.process,), daemon=True).start()
            return self.process.pid

    def _end_after_agent(self, process: subprocess.Popen[bytes]) -> None:
        process.wait()
        time.sleep(LINGER_S)
        self._remove_token()
        os._exit(0)

    def exit_code(self) -> int | None:
        """The agent's exit code; None while it runs."""
        return None if self.process is None else self.process.poll()

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the agent (it stops its workers), SIGKILL after ``grace_s``; its exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        code = self.process.wait()
        self._remove_token()
        return code

    def _remove_token(self) -> None:
        for path in (self.folder / "token", self.folder):
            try:
                path.rmdir() if path.is_dir() else path.unlink()
            except OSError:
                pass


class ClaimsBoard:
    """The claims of every convoy job on the cluster (``ray_claims``), one named detached actor they all share."""

    def __init__(self) -> None:
        self.claims: dict[str, dict] = {}

    def put(self, claim: dict) -> None:
        self.claims[str(claim["job_id"])] = {**claim, "renewed": time.time()}

    def remove(self, job_id: str) -> None:
        self.claims.pop(job_id, None)

    def all(self) -> list[dict]:
        """The claims renewed lately (a job whose driver is gone stops renewing its own)."""
        from convoy.launch.schedulers.ray_claims import STALE_S

        now = time.time()
        self.claims = {job: claim for job, claim in self.claims.items() if now - claim["renewed"] <= STALE_S}
        return list(self.claims.values())
