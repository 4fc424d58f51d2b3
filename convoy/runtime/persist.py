"""Persistent checkpoints with torch.distributed.checkpoint: background saves, atomic and verified.

A save goes to ``checkpoints/step-N.tmp-rR``; when every rank's data and DCP's metadata are
written, rank 0 checksums the files into ``convoy-manifest.json`` and renames the directory to
``step-N``. Only a directory with that name and a manifest that matches its files counts as a
complete checkpoint, so a crash mid-write never leaves one that looks complete. A save starts
only if every rank's round fence allows it, and rank 0 seals it only if its own still does: a
worker of an ended round never adds a checkpoint beside the new round's.

A restore (``PersistentRestore``) works in a world of any size. Model and optimizer state are
resharded by DCP. The per-rank parts (``rank<N>``: data position, RNG, ``model_state``) follow the
rank number: rank r of the new world loads rank r's part where the checkpoint has one; a rank
without one keeps its freshly constructed data position and RNG and takes ``model_state`` from
the lowest saved rank of its own set of peers (if any). Parts of saved ranks the new world lacks
are not used. Each choice is named in the log line.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
import threading
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from convoy.errors import CheckpointError
from convoy.runtime.checkpoint_state import Restored, TrainingState, load_extra, set_rng_state
from convoy.runtime.fence import Fence
from convoy.runtime.slots import flatten, unflatten

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


def dcp_state(state: TrainingState, step: int, rank: int) -> dict[str, Any]:
    """What a save holds: model and optimizer as DCP shards them, and this rank's own part as ``rank<N>``."""
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer or [])
    return {"step": step, "model": model_sd, "optim": optim_sd, f"rank{rank}": state.rank_part()}


def load(state: dict[str, Any], path: Path, group: dist.ProcessGroup) -> None:
    """Load a checkpoint into ``state`` in place (collective over ``group``)."""
    dcp.load(state, checkpoint_id=str(path), process_group=group)


def rank_part_keys(path: Path) -> list[str]:
    """The saved keys of the checkpoint's per-rank parts (``rank<N>.…``), from DCP's metadata."""
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return sorted(key for key in keys if key.startswith("rank"))


def saved_ranks(keys: list[str]) -> list[int]:
    return sorted({int(key.split(".", 1)[0][4:]) for key in keys if key.split(".", 1)[0][4:].isdigit()})


def prune_to_saved(state: Any, path: str, keys: set[str]) -> Any:
    """The part of ``state`` (nested mappings) that the checkpoint holds under ``path``; None if none."""
    if isinstance(state, Mapping):
        kept = {name: part for name, value in state.items()
                if (part := prune_to_saved(value, f"{path}.{name}", keys)) is not None}
        return kept or None
    prefix = path + "."
    return state if path in keys or any(key.startswith(prefix) for key in keys) else None


class PersistentRestore:
    """Resumes from the newest persistent checkpoint under ``root`` that verifies and fits (collective
    over ``group``; rank 0 reads the directory and verifies, every rank loads). ``peers``: this rank's
    set of interchangeable ranks, whose lowest saved rank donates ``model_state`` to a rank not saved."""

    def __init__(self, root: Path, state: TrainingState, *, rank: int, world_size: int, peers: tuple[int, ...],
                 group: dist.ProcessGroup, log: Callable[[str], None]) -> None:
        self.root, self.state, self.rank, self.world_size, self.peers = root, state, rank, world_size, peers
        self.group, self.log = group, log

    def newest(self) -> int | None:
        """Step of the newest complete-looking checkpoint (not yet verified), or None."""
        found = complete_checkpoints(self.root)
        return found[0][0] if found else None

    def restore(self, at_most: int | None = None) -> Restored | None:
        """``at_most``: resume from no checkpoint newer than this step (a rollback)."""
        if self.rank == 0:
            remove_stale_tmp(self.root)
        found = complete_checkpoints(self.root) if self.rank == 0 else None
        if found is not None and at_most is not None:
            found = [(step, path) for step, path in found if step <= at_most]
        listing = [found]
        dist.broadcast_object_list(listing, src=0, group=self.group)
        mismatches = []
        for step, path in listing[0] or []:
            checked = [self._check(path) if self.rank == 0 else None]
            dist.broadcast_object_list(checked, src=0, group=self.group)
            problem, keys = checked[0]  # type: ignore[misc]
            if problem is not None:
                self.log(f"skipping checkpoint {path}: {problem}")
                continue
            target, own, donor = self._load_target(step, keys)
            try:
                load(target, path, self.group)
            except (Exception, CheckpointException) as exc:  # every rank gets the same error from DCP
                mismatches.append(f"{path.name}: {reason(exc)}")
                self.log(f"skipping checkpoint {path}: cannot be loaded into this model ({mismatches[-1]})")
                continue
            set_state_dict(self.state.model, self.state.optimizer or [], model_state_dict=target["model"],
                           optim_state_dict=target["optim"])
            donated = target.get(donor, {}) if donor is not None else {}
            self._apply_rank_part(target.get(own, {}), donated)
            self.log(f"resumed from persistent checkpoint {path} (step {step}){self._describe_parts(keys)}")
            return Restored(step, f"persistent checkpoint {path}")
        if mismatches:
            raise CheckpointError(f"no checkpoint under {self.root} fits this model ({'; '.join(mismatches)}); "
                                  "use a new run dir or restore the model definition")
        return None

    @staticmethod
    def _check(path: Path) -> tuple[str | None, list[str]]:
        """Rank 0: why the checkpoint cannot be used (or None), and its per-rank keys."""
        problem = verify(path)
        if problem is not None:
            return problem, []
        try:
            return None, rank_part_keys(path)
        except (OSError, ValueError, EOFError, pickle.UnpicklingError, CheckpointException) as exc:
            return f"metadata unreadable: {reason(exc)}", []

    def _load_target(self, step: int, keys: list[str]) -> tuple[dict[str, Any], str, str | None]:
        """The state to load in place: model and optimizer (resharded), and only the per-rank parts the
        checkpoint holds: this rank's own, else ``model_state`` from a saved peer (the donor)."""
        model_sd, optim_sd = get_state_dict(self.state.model, self.state.optimizer or [])
        target: dict[str, Any] = {"step": step, "model": model_sd, "optim": optim_sd}
        live = self.state.rank_part()
        saved, key_set, own = saved_ranks(keys), set(keys), f"rank{self.rank}"
        if self.rank in saved:
            part = prune_to_saved(live, own, key_set)
            if part:
                target[own] = part
            return target, own, None
        donor_rank = next((rank for rank in self.peers if rank in saved), None)
        if donor_rank is None or not self.state.shared:
            return target, own, None
        donor = f"rank{donor_rank}"
        part = prune_to_saved({"shared": live["shared"]}, donor, key_set)
        if part:
            target[donor] = part
        return target, own, donor

    def _apply_rank_part(self, mine: dict[str, Any], donated: dict[str, Any]) -> None:
        for name, value in (mine.get("shared") or donated.get("shared") or {}).items():
            load_extra(self.state.shared[name], value)
        for name, value in (mine.get("extra") or {}).items():
            load_extra(self.state.extra[name], value)
        if mine.get("rng"):
            set_rng_state(mine["rng"])

    def _describe_parts(self, keys: list[str]) -> str:
        """How the per-rank parts of a checkpoint from another world size were given out."""
        saved = saved_ranks(keys)
        if saved == list(range(self.world_size)):
            return ""
        fresh = [rank for rank in range(self.world_size) if rank not in saved]
        unused = [rank for rank in saved if rank >= self.world_size]
        said = [f"saved by ranks {saved}, restored on {self.world_size}"]
        if fresh:
            said.append(f"ranks {fresh} have no saved data position or RNG and keep their fresh ones"
                        + (" (model_state from the lowest saved rank of their peers)" if self.state.shared else ""))
        if unused:
            said.append(f"the data position and RNG saved by ranks {unused} are not used")
        return "; " + "; ".join(said)


def stderr_log(message: str) -> None:
    print(f"convoy checkpoint: {message}", file=sys.stderr, flush=True)
