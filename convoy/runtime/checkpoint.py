"""``convoy.Checkpointer``: a snapshot after every step in shared memory, async persistent saves,
and an exact resume from whichever is newest and agreed by every rank.

    ckpt = convoy.Checkpointer(model, optimizer, state={"data": sampler}, persist_every=100)
    for step in range(ckpt.restore(), num_steps):
        ...; optimizer.step()
        ckpt.step(step)          # `step` is finished: it will not be redone after a failure
    ckpt.close()
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel

from convoy import worker_events
from convoy.errors import CheckpointError
from convoy.runtime import persist
from convoy.runtime.checkpoint_state import extra_state, load_extra, peer_sets, rng_state, set_rng_state, shape_mismatch
from convoy.runtime.fence import RoundFence
from convoy.runtime.peers import SnapshotRestore
from convoy.runtime.persist_restore import PersistentRestore
from convoy.runtime.snapshot import HEADER_SIZE, SnapshotFile, SnapshotNoSpace, encode_meta, flatten, free_bytes, layout
from convoy.shm import segment_path

SLACK = 1 << 16
"""Room left in a slot beyond the state's real size, so that a skeleton that grows a little does not regrow it."""


class Checkpointer(SnapshotRestore, PersistentRestore):
    """Makes a training loop resumable at the step after the last finished one.

    ``state`` holds anything else to resume (data position, LR scheduler, generators): objects
    with ``state_dict()``/``load_state_dict()`` or ``torch.Generator``s. In-memory snapshots
    need a convoy agent (``CONVOY_JOB_ID``); persistent saves go to ``directory`` (default
    ``$CONVOY_RUN_DIR/checkpoints``) every ``persist_every`` steps (0: never).
    ``async_snapshot`` copies parameters and optimizer state while the next step computes and
    waits before ``optimizer.step()``; turn it off if parameters change anywhere else.
    ``replicated`` (default: whether ``model`` is DDP) says every rank holds the same model and
    optimizer state. A step counts as finished when ``step()`` returns, before its background
    copy lands; a rank killed in between still holds its own data position and RNG of that step,
    and takes parameters and optimizer state from a rank whose copy landed, so the resume is
    exact and no finished step is redone. A node that just joined takes them the same way and
    starts its data position and RNG fresh. Without ``replicated`` all ranks resume from the
    newest step whose copy landed on every rank, which is exact but may redo the last step.
    ``replicated`` may also list sets of ranks (a partition of the world) whose states are
    interchangeable, e.g. the ranks that hold the same shard in group-wise local SGD: a rank
    without the chosen step takes model and optimizer state from a rank of its own set.
    ``model_state`` holds objects that belong with the model and optimizer (an outer optimizer,
    an LR scheduler): a rank that takes a peer's model takes these from the same peer.
    When ``/dev/shm`` cannot hold the snapshots they are turned off (said once) and persistent
    saves go on; under a convoy agent nothing is committed for a round that is no longer current.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
        state: dict[str, Any] | None = None, every: int = 1, persist_every: int = 0, keep: int = 2,
        directory: str | Path | None = None, async_snapshot: bool = True,
        replicated: bool | Sequence[Sequence[int]] | None = None, model_state: dict[str, Any] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if every < 1 or persist_every < 0 or keep < 1:
            raise CheckpointError(
                f"need every >= 1, persist_every >= 0, keep >= 1 (got {every}, {persist_every}, {keep})")
        if not dist.is_initialized():
            raise CheckpointError("call convoy.init() (or init_process_group) before creating a Checkpointer")
        self.model, self.optimizer, self.extra = model, optimizer, dict(state or {})
        self.shared = dict(model_state or {})
        clash = sorted(set(self.extra) & set(self.shared))
        if clash:
            raise CheckpointError(f"{clash} named in both state and model_state; give each object once")
        self.every, self.persist_every, self.async_snapshot = every, persist_every, async_snapshot
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if replicated is None:
            replicated = isinstance(model, DistributedDataParallel)
        self.peer_sets = peer_sets(replicated, self.world_size)
        self.replicated = any(len(peers) > 1 for peers in self.peer_sets)
        self.log = log or (persist.stderr_log if self.rank == 0 else (lambda message: None))
        self._say = log or persist.stderr_log  # what concerns this rank alone, said on every rank
        self.fence = RoundFence(self._say)
        job_id = os.environ.get("CONVOY_JOB_ID")
        # keyed by node and local rank, not global rank: ranks shift when nodes come and go, and
        # a worker must find its own snapshot on its own host
        worker = f"{os.environ.get('CONVOY_NODE_ID', 'node')}-local{os.environ.get('LOCAL_RANK', self.rank)}"
        self._snapshot = SnapshotFile(segment_path(job_id, worker)) if job_id else None
        self._seq = max((s[0] for s in self._snapshot.slots()), default=0) if self._snapshot else 0
        self._copy_thread: threading.Thread | None = None
        self._copy_error: BaseException | None = None
        self._group = dist.new_group(backend="gloo")  # saves and restores never share the training's group
        self._peers = next(peers for peers in self.peer_sets if self.rank in peers)
        self._peer_group = self._group
        if self.replicated and len(self.peer_sets) > 1:  # every rank makes every group, in one order
            for peers in self.peer_sets:
                group = dist.new_group(list(peers), backend="gloo")
                if self.rank in peers:
                    self._peer_group = group
        root = Path(directory) if directory else Path(os.environ.get("CONVOY_RUN_DIR", ".")) / "checkpoints"
        round_id = int(os.environ.get("CONVOY_ROUND", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        self._saver = persist.PersistentSaver(root, self._group, self.rank, keep, round_id, self.log, self.fence)
        self.root = root
        self.restored_from = "nothing"
        self._check_space()
        if optimizer is not None:
            optimizer.register_step_pre_hook(lambda *args: self._wait_copy())

    # --- what is saved ---

    def _local_state(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict() if self.optimizer is not None else {},
            "extra": {name: extra_state(obj) for name, obj in self.extra.items()},
            "shared": {name: extra_state(obj) for name, obj in self.shared.items()},
            "rng": rng_state(),
        }

    def _apply_local(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optim"])
        self._load_shared(state)
        for name, obj in self.extra.items():
            load_extra(obj, state["extra"][name])
        set_rng_state(state["rng"])

    def _load_shared(self, state: dict[str, Any]) -> None:
        for name, obj in self.shared.items():
            load_extra(obj, state["shared"][name])

    def _dcp_state(self, step: int) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer or [])
        per_rank = {"extra": {n: extra_state(o) for n, o in self.extra.items()},
                    "shared": {n: extra_state(o) for n, o in self.shared.items()}, "rng": rng_state()}
        return {"step": step, "model": model_sd, "optim": optim_sd, f"rank{self.rank}": per_rank}

    # --- saving ---

    def step(self, step: int) -> None:
        """Record that ``step`` finished: snapshot it, and persist it when due."""
        self._wait_copy()
        if self._snapshot is not None and step % self.every == 0:
            self._take_snapshot(step)
        if self.persist_every and (step + 1) % self.persist_every == 0:
            stable = self._stable_until_optimizer_step() if self.async_snapshot else set()
            self._saver.save_async(self._dcp_state(step), step, stable)

    def _take_snapshot(self, step: int) -> None:
        assert self._snapshot is not None
        if not self.fence.allows(f"snapshot of step {step}"):
            return  # the previous snapshot stays the newest
        tensors: list[torch.Tensor] = []
        skeleton = flatten(self._local_state(step), tensors)
        offsets, data_len = layout(tensors)
        stable = self._stable_until_optimizer_step()
        later = [i for i, t in enumerate(tensors) if self.async_snapshot and t.data_ptr() in stable]
        meta = encode_meta(skeleton, offsets, frozenset(later))
        if not self._snapshot.fits(data_len, len(meta)) and not self._grow(data_len + 2 * len(meta) + SLACK):
            return
        self._seq += 1
        index = self._snapshot.begin(self._seq)
        later_set = set(later)
        now = [i for i in range(len(tensors)) if i not in later_set]
        try:
            self._snapshot.write_tensors(index, [tensors[i] for i in now], [offsets[i] for i in now])
            # partial until the background copy lands: this rank's own part of ``step`` is in place
            self._snapshot.commit_meta(index, self._seq, step, meta, data_len, complete=not later)
        except OSError as exc:
            raise CheckpointError(f"in-memory snapshot failed: {exc}") from exc
        if not later:
            return

        def finish() -> None:
            try:
                self._snapshot.write_tensors(index, [tensors[i] for i in later], [offsets[i] for i in later])  # type: ignore[union-attr]
                if self.fence.allows(f"snapshot of step {step}"):
                    self._snapshot.mark_complete(index)  # type: ignore[union-attr]
            except BaseException as exc:  # noqa: BLE001 (re-raised in the training thread)
                self._copy_error = exc

        self._copy_thread = threading.Thread(target=finish, name="convoy-snapshot", daemon=True)
        self._copy_thread.start()

    def _check_space(self) -> None:
        """At construction: turn snapshots off at once if shared memory cannot hold even the model twice."""
        if self._snapshot is None:
            return
        model_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values()
                          if isinstance(t, torch.Tensor))
        needed = HEADER_SIZE + 2 * (model_bytes + SLACK)
        free = free_bytes(self._snapshot.path.parent) + self._snapshot.size_on_disk()
        if needed > free:
            self._disable_snapshots(f"two snapshots of this model need {needed / 2**20:.1f} MiB, "
                                    f"{self._snapshot.path.parent} has {free / 2**20:.1f} MiB free")

    def _grow(self, slot_size: int) -> bool:
        """Make room for a larger snapshot; False (snapshots now off) when shared memory cannot hold it."""
        assert self._snapshot is not None
        try:
            self._snapshot.allocate(slot_size)
        except SnapshotNoSpace as exc:
            self._disable_snapshots(str(exc))
            return False
        return True

    def _disable_snapshots(self, why: str) -> None:
        """Say once why in-memory snapshots stop, record it, drop the segment; training goes on."""
        assert self._snapshot is not None
        self._snapshot.remove()
        self._snapshot = None
        then = (f"persistent saves every {self.persist_every} steps go on (to {self.root})" if self.persist_every
                else "persist_every is 0, so nothing protects progress now: set persist_every, or give /dev/shm "
                     "more room (e.g. docker --shm-size)")
        message = f"in-memory snapshots turned off on rank {self.rank}: {why}; {then}"
        self._say(message)
        worker_events.emit("snapshot_disabled", message)

    def _stable_until_optimizer_step(self) -> set[int]:
        """Storage of tensors that only ``optimizer.step()`` changes: safe to copy in the background."""
        if self.optimizer is None:
            return set()
        ptrs = {p.data_ptr() for p in self.model.parameters()}
        for param_state in self.optimizer.state.values():
            ptrs.update(v.data_ptr() for v in param_state.values() if isinstance(v, torch.Tensor))
        return ptrs

    def _wait_copy(self) -> None:
        self._saver.wait_staged()
        if self._copy_thread is not None:
            self._copy_thread.join()
            self._copy_thread = None
        self._raise_copy_error()

    def _raise_copy_error(self) -> None:
        if self._copy_error is not None:
            error, self._copy_error = self._copy_error, None
            raise CheckpointError(f"in-memory snapshot failed: {error}") from error

    def close(self) -> None:
        """Wait for the background copy and any persistent save in flight."""
        self._wait_copy()
        self._saver.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- restoring ---

    def restore(self) -> int:
        """Load the newest state every rank has; return the step to start from (0: fresh)."""
        step = self._restore_snapshot()
        if step is None:
            step = self._restore_persistent()
        return 0 if step is None else step + 1

    def _agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _fits(self, state: dict[str, Any], step: int) -> bool:
        """Every rank checks its snapshot against its model; all agree, or none uses theirs."""
        problem = shape_mismatch(self.model.state_dict(), state["model"], "model") or self._optim_mismatch(state)
        if self._agree(problem is None):
            return True
        self.log(f"in-memory snapshot of step {step} does not fit this model ({problem or 'on another rank'}); "
                 "trying persistent checkpoints")
        return False

    def _optim_mismatch(self, state: dict[str, Any]) -> str | None:
        """Saved optimizer state must match the parameters it belongs to, in count and shape."""
        if self.optimizer is None:
            return None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        saved_groups = state["optim"].get("param_groups", [])
        if sum(len(g["params"]) for g in saved_groups) != len(params):
            return "optimizer: saved a different number of parameters"
        for index, param_state in state["optim"].get("state", {}).items():
            for name, value in param_state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[index].shape:
                    model = tuple(params[index].shape)
                    return f"optimizer state {index}.{name}: saved {tuple(value.shape)}, model {model}"
        return None
