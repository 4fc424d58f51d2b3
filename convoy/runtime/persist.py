"""Persistent checkpoints with torch.distributed.checkpoint: async saves, atomic and verified.

A save goes to ``checkpoints/step-N.tmp-rR``; when every rank's data and DCP's metadata are
written, rank 0 checksums the files into ``convoy-manifest.json`` and renames the directory to
``step-N``. Only a directory with that name and a manifest that matches its files counts as a
complete checkpoint, so a crash mid-write never leaves one that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

MANIFEST = "convoy-manifest.json"
_COMPLETE = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 22


def reason(exc: BaseException) -> str:
    """The last line of an error (DCP's cause), not its multi-rank traceback dump."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoints under ``root``, newest first (verify before trusting one)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _COMPLETE.match(path.name)
        if match and (path / MANIFEST).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(path: Path, step: int) -> None:
    files = {f.name: {"size": f.stat().st_size, "crc32": _crc(f)} for f in sorted(path.iterdir()) if f.is_file()}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}))
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    tmp.rename(path / MANIFEST)


def verify(path: Path) -> str | None:
    """None if every file listed in the manifest is there with its size and checksum; else why not."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for name, expected in manifest["files"].items():
            file = path / name
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != expected["size"]:
                return f"{name} is {file.stat().st_size} bytes, expected {expected['size']} (truncated?)"
            if _crc(file) != expected["crc32"]:
                return f"{name} fails its checksum (corrupt)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"manifest unreadable: {exc}"
    return None


def remove_stale_tmp(root: Path) -> None:
    """Drop half-written saves left by a crash (rank 0, before any new save starts)."""
    if root.is_dir():
        for path in root.glob("step-*.tmp-*"):
            shutil.rmtree(path, ignore_errors=True)


class PersistentSaver:
    """Runs one async DCP save at a time on its own process group; rank 0 seals each save."""

    def __init__(self, root: Path, group: dist.ProcessGroup, rank: int, keep: int, round_id: int,
                 log: Callable[[str], None]) -> None:
        self.root, self.group, self.rank, self.keep, self.round_id, self.log = root, group, rank, keep, round_id, log
        self._pending: threading.Thread | None = None
        self.last_error: BaseException | None = None

    def save_async(self, state: dict[str, Any], step: int) -> None:
        """Stage ``state`` (blocking copy) and write it in the background."""
        self.wait()
        tmp = self.root / f"{step_dir(self.root, step).name}.tmp-r{self.round_id}"
        try:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
        except (Exception, CheckpointException) as exc:  # a failed save is reported, training goes on
            self._failed(step, tmp, exc)
            return
        self._pending = threading.Thread(target=self._finish, args=(future, step, tmp), name="convoy-seal", daemon=True)
        self._pending.start()

    def wait(self) -> None:
        """Block until the save in flight is written and sealed (or has failed)."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None

    def _finish(self, future: Future[Any], step: int, tmp: Path) -> None:
        error = future.exception()
        if error is not None:
            self._failed(step, tmp, error)
            return
        if self.rank != 0:
            return
        try:
            write_manifest(tmp, step)
            final = step_dir(self.root, step)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            for _, old in complete_checkpoints(self.root)[self.keep :]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            self._failed(step, tmp, exc)

    def _failed(self, step: int, tmp: Path, error: BaseException) -> None:
        self.last_error = error
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            newest = complete_checkpoints(self.root)
            kept = f"step {newest[0][0]}" if newest else "none yet"
            self.log(f"persistent save of step {step} failed ({reason(error)}); training goes on, "
                     f"in-memory snapshots continue; newest complete checkpoint: {kept}")


def load(state: dict[str, Any], path: Path, group: dist.ProcessGroup) -> None:
    """Load a checkpoint into ``state`` in place (collective over ``group``)."""
    dcp.load(state, checkpoint_id=str(path), process_group=group)


def stderr_log(message: str) -> None:
    print(f"convoy checkpoint: {message}", file=sys.stderr, flush=True)
