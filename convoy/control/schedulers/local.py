"""The local scheduler: each node is an agent subprocess on this host."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from convoy.config import WorkerConfig
from convoy.procs import die_with_parent


class LocalScheduler:
    """Starts agents as child processes; they die with the launcher (SIGTERM on its death)."""

    def __init__(self, master_url: str, token_file: Path, run_dir: Path, workers: WorkerConfig) -> None:
        self.master_url, self.token_file, self.run_dir, self.workers = master_url, token_file, run_dir, workers
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def start_node(self, index: int) -> str:
        node_id = f"local{index}"
        command = [
            sys.executable, "-m", "convoy", "agent", "--master", self.master_url,
            "--token-file", str(self.token_file), "--run-dir", str(self.run_dir), "--node-id", node_id,
            "--host", "127.0.0.1", "--nproc-per-node", str(self.workers.nproc_per_node),
            "--stop-grace", str(self.workers.stop_grace_s), "--preload", ",".join(self.workers.preload),
        ]
        command += ["-m", self.workers.entrypoint] if self.workers.module else [self.workers.entrypoint]
        command += self.workers.args
        self.agents[node_id] = subprocess.Popen(command, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        return node_id

    def running(self) -> list[str]:
        return [node_id for node_id, proc in self.agents.items() if proc.poll() is None]

    def wait(self, timeout: float) -> bool:
        """Wait for every agent to exit; False if some are still running at the deadline."""
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.running()

    def stop(self, grace_s: float) -> None:
        """SIGTERM the agents (they stop their workers), SIGKILL any still there after the grace period."""
        for node_id in self.running():
            self.agents[node_id].send_signal(signal.SIGTERM)
        if not self.wait(grace_s):
            for node_id in self.running():
                self.agents[node_id].kill()
        for proc in self.agents.values():
            proc.wait()
