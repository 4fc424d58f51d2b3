"""The local scheduler: the master and each node's agent are child processes on this host."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from convoy.config import JobConfig
from convoy.procs import die_with_parent

CONVOY = [sys.executable, "-m", "convoy"]


class LocalScheduler:
    """Starts the master and the agents; all of them get SIGTERM if the launcher dies."""

    def __init__(self, config: JobConfig, token_file: Path, port: int) -> None:
        self.config, self.token_file, self.port = config, token_file, port
        self.master: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self._reported: dict[int, subprocess.Popen[bytes]] = {}
        """pid -> the exited agent reported for it; holding the object keeps its identity unique."""

    def start_master(self, resume: bool) -> None:
        master = self.config.master
        run_dir = str(master.run_dir)
        if resume:
            args = ["--resume", run_dir]
        else:
            rdzv = master.rendezvous
            args = ["--host", "127.0.0.1", "--port", str(self.port), "--run-dir", run_dir,
                    "--nnodes", f"{rdzv.min_nodes}:{rdzv.max_nodes}", "--max-restarts", str(master.max_restarts),
                    "--rdzv-wait", str(rdzv.wait_s), "--join-timeout", str(rdzv.join_timeout_s),
                    "--heartbeat-timeout", str(master.heartbeat_timeout_s), "--job-id", master.job_id,
                    "--max-regroups", str(master.max_regroups), "--regroup-window", str(master.regroup_window_s)]
        self.master = self._spawn(["master", *args, "--token-file", str(self.token_file), "--under-run"])

    def start_node(self, node_id: str) -> None:
        workers = self.config.workers
        command = [
            "agent", "--master", f"127.0.0.1:{self.port}", "--token-file", str(self.token_file),
            "--run-dir", str(self.config.master.run_dir), "--node-id", node_id, "--host", "127.0.0.1",
            "--nproc-per-node", str(workers.nproc_per_node), "--stop-grace", str(workers.stop_grace_s),
            "--preload", ",".join(workers.preload), "--job-id", self.config.master.job_id,
        ]
        command += ["-m", workers.entrypoint] if workers.module else [workers.entrypoint]
        self.agents[node_id] = self._spawn(command + workers.args)

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(CONVOY + args, preexec_fn=lambda: die_with_parent(signal.SIGTERM))

    def master_exit(self) -> int | None:
        return None if self.master is None else self.master.poll()

    def running(self) -> list[str]:
        return [node_id for node_id, proc in self.agents.items() if proc.poll() is None]

    def newly_exited(self) -> list[tuple[str, int]]:
        """Agents that exited since the last call, with their exit codes."""
        exited = []
        for node_id, proc in self.agents.items():
            if proc.poll() is not None and self._reported.get(proc.pid) is not proc:
                self._reported[proc.pid] = proc
                exited.append((node_id, proc.returncode))
        return exited

    def wait(self, timeout: float) -> bool:
        """Wait for every child to exit; False if some are still running at the deadline."""
        deadline = time.monotonic() + timeout
        while (self.running() or self.master_exit() is None) and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.running() and self.master_exit() is not None

    def stop(self, grace_s: float) -> None:
        """SIGTERM every child (agents stop their workers), SIGKILL any still there after the grace period."""
        children = [proc for proc in [self.master, *self.agents.values()] if proc is not None]
        for proc in children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        if not self.wait(grace_s):
            for proc in children:
                if proc.poll() is None:
                    proc.kill()
        for proc in children:
            proc.wait()
