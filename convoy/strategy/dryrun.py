"""Start the search's dry-run ranks as real processes on gloo, wait for them, and read their results.

Every rank runs ``convoy.strategy.worker`` with torchrun's variables; ``place(rank)`` may put a rank
in another network namespace (a command prefix and environment), as the benchmark's two-tier network
does. A rank that fails stops the others, and the error carries the end of its output; a rank's
``ConfigError`` (a script without ``workload()``, say) is raised again as it is, one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from convoy.errors import ConfigError, ConvoyError
from convoy.ports import unclaimed_port
from convoy.strategy.candidates import Hardware
from convoy.strategy.workload import MMAP_THRESHOLD

Placement = Callable[[int], tuple[list[str], dict[str, str]]]
CONFIG_ERROR = "convoy-plan-config-error: "
"""Starts the line a rank prints for a ``ConfigError`` before it exits 2; ``run_search`` raises it again."""


def run_search(script: str, args: Sequence[str], hardware: Hardware, *, exhaustive_steps: int = 0,
               exhaustive_rounds: int = 1, keep: int = 8, first_steps: int = 1, place: Placement | None = None,
               timeout_s: float = 1800.0) -> dict[str, Any]:
    """Run the dry runs of ``script`` on ``hardware.world_size`` local processes; their results.

    ``exhaustive_steps`` > 0 also measures every feasible candidate after the search (a benchmark's
    grid), ``exhaustive_rounds`` times in rotated order, ``exhaustive_steps`` timed steps each time."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="convoy-plan-") as tmp:
        out = Path(tmp) / "result.json"
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({
            "script": str(Path(script).resolve()), "args": list(args), "nodes": hardware.nodes,
            "nproc_per_node": hardware.nproc_per_node, "memory": hardware.memory_limit, "cores": hardware.cores,
            "keep": keep, "first_steps": first_steps, "exhaustive_steps": exhaustive_steps,
            "exhaustive_rounds": exhaustive_rounds, "out": str(out)}))
        port = str(unclaimed_port())
        procs = []
        logs = []
        for rank in range(hardware.world_size):
            prefix, extra = place(rank) if place else ([], {})
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank % hardware.nproc_per_node),
                   "WORLD_SIZE": str(hardware.world_size), "LOCAL_WORLD_SIZE": str(hardware.nproc_per_node),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                   "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, **extra}
            log = open(Path(tmp) / f"rank{rank}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen([*prefix, sys.executable, "-m", "convoy.strategy.worker", str(spec)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            failed = _wait(procs, timeout_s)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if failed is not None:
            logs[failed].seek(0)
            output = logs[failed].read()
            for line in output.splitlines():  # the script or the plan is wrong: said as the rank said it
                if line.startswith(CONFIG_ERROR):
                    raise ConfigError(line.removeprefix(CONFIG_ERROR))
            raise ConvoyError(f"dry-run rank {failed} failed (exit {procs[failed].returncode}):\n{output[-1500:]}")
        for log in logs:
            log.close()
        result = json.loads(out.read_text())
        result["wall_s"] = time.perf_counter() - started  # the ranks' start included
        return result


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> int | None:
    """Wait for every rank; the first that failed (or timed out), else None."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [proc.poll() for proc in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                return rank
        if all(code == 0 for code in codes):
            return None
        if time.monotonic() > deadline:
            return next(rank for rank, code in enumerate(codes) if code is None)
        time.sleep(0.1)
