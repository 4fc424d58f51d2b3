"""Where shared memory lives, the names of a job's segments (snapshots, leases, rings, lanes, weight boards), and
how one is made and mapped; torch-free so the agent can clean them."""

from __future__ import annotations

import mmap
import os
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


def create_mapped(path: Path, size: int) -> mmap.mmap:
    """A new segment of ``size`` bytes at ``path`` (mode 0600; an existing file or a link there is an error), its
    pages reserved now, mapped. Raises ``OSError`` (ENOSPC: /dev/shm is full, here and not as SIGBUS on a first
    write later) and leaves nothing at ``path`` when it does."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def open_mapped(path: Path) -> mmap.mmap:
    """An existing segment mapped whole, not through a link. Raises ``OSError``."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
