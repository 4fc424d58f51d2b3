"""Where shared memory lives, and the names of a job's segments (snapshots, leases); torch-free so the agent
can clean them."""

from __future__ import annotations

import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def segment_prefix(job_id: str) -> str:
    return f"convoy-{job_id}-"


def segment_path(job_id: str, worker: int | str) -> Path:
    """One worker's segment: by rank, or by a name that stays put across rounds (node + local rank)."""
    name = f"rank{worker}" if isinstance(worker, int) else re.sub(r"[^A-Za-z0-9_.-]", "_", worker)
    return SHM_DIR / f"{segment_prefix(job_id)}{name}"


def remove_segments(job_id: str, node_id: str = "") -> list[Path]:
    """Unlink every snapshot segment of a job (its agents and launcher call this at the end); with ``node_id``,
    only that node's (an agent leaving a job that goes on: another node of the job may share this host)."""
    removed = []
    node = re.sub(r"[^A-Za-z0-9_.-]", "_", node_id)
    patterns = [f"{segment_prefix(job_id)}{node}-*", f"{segment_prefix(job_id)}lease-{node}"] if node_id else \
        [f"{segment_prefix(job_id)}*"]
    for path in (path for pattern in patterns for path in SHM_DIR.glob(pattern)):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
