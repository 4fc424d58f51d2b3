"""Start the processes of one benchmark job and wait for all of them (shared by the benchmarks)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def rank_env(rank: int, world: int, port: str, **extra: str) -> dict[str, str]:
    """torchrun's variables for one rank of a one-node job on loopback, convoy importable."""
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def run_ranks(commands: Sequence[tuple[list[str], dict[str, str]]], what: str, timeout: float = 3600) -> None:
    """Run one process per (argv, env), all at once; ``RuntimeError`` with the tail of each
    failed rank's output unless every one exits 0."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv, env in commands]
    failed = []
    for rank, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            failed.append(f"{what} rank {rank} exited {proc.returncode}: {output[-1500:]}")
    if failed:
        raise RuntimeError("\n".join(failed))
