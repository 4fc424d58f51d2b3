"""The jobs of benchmarks/launch.py: convoy's and torchrun's launchers on ddp_steps.py, each in its own session,
their steps followed through steplog, and the moment a worker may be killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import psutil
from steplog import StepLog
from warm import agent_is_warm

SCRIPT = Path(__file__).resolve().parent / "ddp_steps.py"
NPROC = 2
POLL_S = 0.05
MB = 1024 * 1024
T = TypeVar("T")


def _tool(name: str, module: str) -> list[str]:
    path = Path(sys.executable).parent / name
    return [str(path)] if path.exists() else [sys.executable, "-m", module]


LAUNCHERS = {"convoy": _tool("convoy", "convoy"), "torchrun": _tool("torchrun", "torch.distributed.run")}
TORCHRUN_OWN_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""torchrun's opt-out of the agent-owned TCPStore: each round's rank 0 worker then hosts a new store on a new
port, so a restarted group cannot read the addresses its predecessors left in the old one."""
KINDS: dict[str, tuple[str, dict[str, str]]] = {
    "convoy": ("convoy", {}),
    "torchrun": ("torchrun", TORCHRUN_OWN_STORE),
    "torchrun-shared": ("torchrun", {}),
}
"""Benchmark kind -> (launcher, extra environment). ``torchrun`` is torchrun at its best (the opt-out set);
``torchrun-shared`` is torchrun's default store, run for the kills only, to show why it recovers less often."""


class Job:
    """One launcher command in its own session; ``stop()`` ends it and every process it started."""

    def __init__(self, kind: str, tmp: Path, max_restarts: int) -> None:
        tmp.mkdir(parents=True)
        self.kind, self.out, self.log_path = kind, tmp / "steps", tmp / "console.log"
        self.launcher, extra_env = KINDS[kind]
        options = (["--standalone"] if self.launcher == "torchrun"
                   else ["run", "--nnodes", "1", "--run-dir", str(tmp / "run")])
        argv = [*LAUNCHERS[self.launcher], *options, "--nproc-per-node", str(NPROC),
                "--max-restarts", str(max_restarts), str(SCRIPT), "--out", str(self.out)]
        self.steps = StepLog(self.out)
        with open(self.log_path, "wb") as log:
            self.started = time.time()
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, **extra_env})
        self.root = psutil.Process(self.proc.pid)
        self.known: dict[int, psutil.Process] = {self.proc.pid: self.root}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def track(self) -> None:
        """Remember every descendant, so that stop() finds those whose parent died first."""
        try:
            for child in self.root.children(recursive=True):
                self.known.setdefault(child.pid, child)
        except psutil.Error:
            pass

    def agents(self) -> list[psutil.Process]:
        try:
            return [c for c in self.root.children() if "agent" in c.cmdline()]
        except psutil.Error:
            return []

    def stop(self, grace_s: float = 15.0) -> None:
        self.track()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        for proc in self.known.values():
            try:
                proc.kill()  # psutil checks the pid still names the same process
            except psutil.Error:
                pass
        psutil.wait_procs(list(self.known.values()), timeout=5)
        self.proc.wait()

    def last_error(self) -> str:
        """The console's last line that names an error (else its last line), shortened."""
        lines = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line]
        return (errors or lines or ["(no output)"])[-1][:240]


def wait_for(job: Job, probe: Callable[[], T | None], timeout_s: float) -> T | None:
    """Poll ``probe`` until it returns a value, the job exits, or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job.steps.poll()
        job.track()
        value = probe()
        if value is not None:
            return value
        if not job.alive():
            job.steps.poll()
            return probe()
        time.sleep(POLL_S)
    return None


def ready_to_kill(job: Job, settle_s: float) -> bool:
    """Every rank has trained ``settle_s`` in this round and (convoy) the agent can start the next without an import."""
    current = job.steps.current()
    if len(current) < NPROC:
        return False
    for rank, latest in current.items():
        first = next(s for s in job.steps.steps if s.rank == rank and s.pid == latest.pid)
        if latest.t - first.t < settle_s:
            return False
    if job.launcher != "convoy":
        return True
    workers = {s.pid for s in current.values()}
    return all(agent_is_warm(agent, workers, NPROC) for agent in job.agents())
