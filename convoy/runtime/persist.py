"""Persistent checkpoints with torch.distributed.checkpoint: background saves, atomic and verified.

A save goes to ``checkpoints/step-N.tmp-rR``; when every rank's data and DCP's metadata are
written, rank 0 checksums the files into ``convoy-manifest.json`` and renames the directory to
``step-N``. Only a directory with that name and a manifest that matches its files counts as a
complete checkpoint, so a crash mid-write never leaves one that looks complete. A save starts
only if every rank's round fence allows it, and rank 0 seals it only if its own still does: a
worker of an ended round never adds a checkpoint beside the new round's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import zlib
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from convoy.runtime.snapshot import flatten, unflatten

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


class Fence(Protocol):
    def allows(self, what: str) -> bool: ...


class PersistentSaver:
    """One background DCP save at a time, on its own process group; rank 0 seals each save."""

    def __init__(self, root: Path, group: dist.ProcessGroup, rank: int, keep: int, round_id: int,
                 log: Callable[[str], None], fence: Fence | None = None) -> None:
        self.root, self.group, self.rank, self.keep, self.round_id, self.log = root, group, rank, keep, round_id, log
        self.fence = fence
        self._pending: threading.Thread | None = None
        self._staged = threading.Event()
        self._buffers: list[torch.Tensor] = []
        self.last_error: BaseException | None = None

    def save_async(self, state: dict[str, Any], step: int, stable: set[int]) -> None:
        """Copy ``state`` into reused staging buffers and write it on a background thread.

        Tensors whose storage is in ``stable`` (parameters, optimizer state) are copied in the
        background too; the training loop only waits (``wait_staged``, before the next
        ``optimizer.step()``) if that copy has not finished while the next forward and backward
        ran. Everything else (buffers a forward may change) is copied here and now.
        """
        self.wait()
        tmp = self.root / f"{step_dir(self.root, step).name}.tmp-r{self.round_id}"
        tensors: list[torch.Tensor] = []
        skeleton = flatten(state, tensors)
        if [(t.shape, t.dtype) for t in self._buffers] != [(t.shape, t.dtype) for t in tensors]:
            self._buffers = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
        later = [i for i, t in enumerate(tensors) if t.data_ptr() in stable]
        for i in sorted(set(range(len(tensors))) - set(later)):
            self._buffers[i].copy_(tensors[i].detach())
        self._staged.clear()
        self._pending = threading.Thread(target=self._write, args=(skeleton, [(i, tensors[i]) for i in later], step,
                                                                   tmp), name="convoy-persist", daemon=True)
        self._pending.start()

    def wait_staged(self) -> None:
        """Block until the save in flight no longer reads the live tensors."""
        if self._pending is not None:
            self._staged.wait()

    def wait(self) -> None:
        """Block until the save in flight is written and sealed (or has failed)."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None

    def _write(self, skeleton: Any, later: list[tuple[int, torch.Tensor]], step: int, tmp: Path) -> None:
        try:
            for index, tensor in later:
                self._buffers[index].copy_(tensor.detach())
        finally:
            self._staged.set()
        try:
            if not self._all_allowed(f"persistent checkpoint of step {step}"):
                return
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
            dcp.save(unflatten(skeleton, self._buffers), checkpoint_id=str(tmp), process_group=self.group)
            if self.rank == 0:
                if self._allowed(f"persistent checkpoint of step {step}"):
                    self._seal(step, tmp)
                else:
                    shutil.rmtree(tmp, ignore_errors=True)
        except (Exception, CheckpointException) as exc:  # a failed save is reported, training goes on
            self._failed(step, tmp, exc)

    def _allowed(self, what: str) -> bool:
        return self.fence is None or self.fence.allows(what)

    def _all_allowed(self, what: str) -> bool:
        """Every rank's fence allows the save (agreed, so that no rank waits in a save the others skip)."""
        flag = torch.tensor([1 if self._allowed(what) else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _seal(self, step: int, tmp: Path) -> None:
        write_manifest(tmp, step)
        final = step_dir(self.root, step)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in complete_checkpoints(self.root)[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)

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
