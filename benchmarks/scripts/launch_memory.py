"""The memory side of benchmarks/launch.py: per-process RSS of the launchers, agents and a standalone master,
the whole process tree's USS and PSS, and how long the import a standby has made takes in a fresh process."""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from launch_jobs import LAUNCHERS, MB, Job
from warm import FORK_SERVER

def rss_mb(proc: psutil.Process) -> float | None:
    try:
        return proc.memory_info().rss / MB
    except psutil.Error:
        return None


def launcher_rss(job: Job) -> dict[str, float]:
    if job.launcher == "torchrun":
        found = {"torchrun (agent)": rss_mb(job.root)}
    else:
        agents = job.agents()
        found = {"convoy run (launcher + master)": rss_mb(job.root),
                 "convoy agent": rss_mb(agents[0]) if agents else None}
    return {name: value for name, value in found.items() if value is not None}


@dataclass
class TreeMemory:
    """One sample of a job's whole process tree: the launcher and every descendant."""

    uss: float = 0.0
    """Sum of USS (pages no other process maps), MB."""
    pss: float = 0.0
    """Sum of PSS (each shared page split among the processes that map it), MB."""
    parts: dict[str, list[float]] = field(default_factory=dict)
    """Part of the tree -> the USS of each of its processes, MB."""


def _tree_part(job: Job, proc: psutil.Process, workers: set[int], agents: set[int]) -> str:
    if proc.pid == job.root.pid:
        return "torchrun (agent)" if job.launcher == "torchrun" else "launcher + master"
    if proc.pid in agents:
        return "agent"
    if proc.pid in workers:
        return "workers"
    if proc.ppid() in agents:  # a child of convoy's agent that trains no rank: what the next workers start from
        return "fork server" if FORK_SERVER in " ".join(proc.cmdline()) else "standbys"
    return "other"


def tree_memory(job: Job) -> TreeMemory | None:
    """USS and PSS summed over the job's tree (the launcher and all its descendants, on this one node)."""
    try:
        procs = [job.root, *job.root.children(recursive=True)]
    except psutil.Error:
        return None
    workers = {s.pid for s in job.steps.current().values()}
    agents = {a.pid for a in job.agents()} if job.launcher == "convoy" else set()
    sample = TreeMemory()
    for proc in procs:
        try:
            info = proc.memory_full_info()
            part = _tree_part(job, proc, workers, agents)
        except psutil.Error:
            continue  # it ended between the listing and the read
        sample.uss += info.uss / MB
        sample.pss += info.pss / MB
        sample.parts.setdefault(part, []).append(info.uss / MB)
    return sample


def import_seconds(modules: tuple[str, ...], repeats: int) -> float | None:
    """Median seconds a fresh interpreter takes to import ``modules``: what a convoy standby has done already."""
    code = f"import time; t = time.perf_counter(); import {', '.join(modules)}; print(time.perf_counter() - t)"
    times = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            times.append(float(done.stdout.split()[-1]))
    return statistics.median(times) if times else None


def standalone_master_rss(tmp: Path) -> float | None:
    """RSS of ``convoy master`` once it has printed its token file line."""
    tmp.mkdir(parents=True)
    argv = [*LAUNCHERS["convoy"], "master", "--nnodes", "1", "--run-dir", str(tmp), "--port", "0"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    watchdog = threading.Timer(30.0, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            if b"token file" in line:
                time.sleep(0.5)
                return rss_mb(psutil.Process(proc.pid))
        return None
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
