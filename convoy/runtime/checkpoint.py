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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from convoy.errors import CheckpointError
from convoy.runtime import persist
from convoy.runtime.checkpoint_state import (
    extra_state, load_extra, peer_sets, rng_state, set_rng_state, shape_mismatch,
)
from convoy.runtime.snapshot import SnapshotFile, flatten, layout, map_leaves
from convoy.shm import segment_path

META_RESERVE = 1 << 20


class Checkpointer:
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
        self._saver = persist.PersistentSaver(root, self._group, self.rank, keep, round_id, self.log)
        self.root = root
        self.restored_from = "nothing"
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
        tensors: list[torch.Tensor] = []
        skeleton = flatten(self._local_state(step), tensors)
        offsets, data_len = layout(tensors)
        if not self._snapshot.fits(data_len, META_RESERVE // 2):
            self._snapshot.allocate(data_len + META_RESERVE)
        self._seq += 1
        index = self._snapshot.begin(self._seq)
        stable = self._stable_until_optimizer_step()
        later = [i for i, t in enumerate(tensors) if self.async_snapshot and t.data_ptr() in stable]
        later_set = set(later)
        now = [i for i in range(len(tensors)) if i not in later_set]
        try:
            self._snapshot.write_tensors(index, [tensors[i] for i in now], [offsets[i] for i in now])
            # partial until the background copy lands: this rank's own part of ``step`` is in place
            self._snapshot.commit(index, self._seq, step, skeleton, offsets, data_len, pending=frozenset(later))
        except OSError as exc:
            raise CheckpointError(f"in-memory snapshot failed: {exc}") from exc
        if not later:
            return

        def finish() -> None:
            try:
                self._snapshot.write_tensors(index, [tensors[i] for i in later], [offsets[i] for i in later])  # type: ignore[union-attr]
                self._snapshot.mark_complete(index)  # type: ignore[union-attr]
            except BaseException as exc:  # noqa: BLE001 (re-raised in the training thread)
                self._copy_error = exc

        self._copy_thread = threading.Thread(target=finish, name="convoy-snapshot", daemon=True)
        self._copy_thread.start()

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

    def _restore_snapshot(self) -> int | None:
        """Pick the step to resume from what every rank holds in shared memory, and load it.

        A snapshot is *whole* once its background copy landed, *partial* before (only the rank's
        own data position and RNG are certain). A step is *covered* when every set of peers has a
        rank holding it whole. State resumes from the newest covered step that every rank holds at
        least partially: a worker killed while its copy was in flight loses no finished step.
        Failing that (a node just joined, or peers drifted apart), from the newest covered step,
        ranks without it taking a peer's. Without peers, covered means every rank holds it whole."""
        snap = self._snapshot
        held = (snap.steps(), snap.steps(partial=True)) if snap is not None else ([], [])
        every: list[tuple[list[int], list[int]]] = [([], []) for _ in range(self.world_size)]
        dist.all_gather_object(every, held, group=self._group)
        whole, some = [set(w) for w, _ in every], [set(p) for _, p in every]
        covered = {step for step in set().union(*whole)
                   if all(any(step in whole[rank] for rank in peers) for peers in self.peer_sets)}
        candidates = set.intersection(*some) & covered or covered
        if not candidates:
            return None
        step = max(candidates)
        if all(step in w for w in whole):
            return self._restore_own(step)
        return self._restore_from_peer(step, [step in w for w in whole])

    def _restore_own(self, step: int) -> int | None:
        assert self._snapshot is not None
        views = self._snapshot.read(step, copy=False)
        if not self._fits(views, step):
            return None
        self._apply_snapshot(views)
        self.restored_from = f"in-memory snapshot of step {step}"
        self.log(f"resumed from the in-memory snapshot of step {step}")
        return step

    def _apply_snapshot(self, views: dict[str, Any]) -> None:
        """``_apply_local`` from views into shared memory, copying each byte once: load_state_dict copies
        the model's tensors into its parameters and buffers; extras and RNG are small and cloned; the
        optimizer adopts empty tensors that a background thread fills while the first step computes
        (the optimizer's pre-step hook waits for it, as it does for a snapshot's copy)."""
        small = {key: map_leaves(views[key], torch.Tensor, torch.Tensor.clone) for key in ("extra", "shared", "rng")}
        if self.optimizer is None:
            self._apply_local({**views, **small})
            return
        saved = views["optim"].get("state", {})
        empty = {**views["optim"], "state": map_leaves(saved, torch.Tensor, torch.empty_like)}
        self._apply_local({"model": views["model"], "optim": empty, **small})
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        pairs = [(self.optimizer.state[params[index]][name], value) for index, param_state in saved.items()
                 for name, value in param_state.items() if isinstance(value, torch.Tensor)]

        def fill() -> None:
            try:
                for live, value in pairs:
                    live.copy_(value)
            except BaseException as exc:  # noqa: BLE001 (re-raised in the training thread)
                self._copy_error = exc

        self._copy_thread = threading.Thread(target=fill, name="convoy-restore", daemon=True)
        self._copy_thread.start()

    def _fits(self, state: dict[str, Any], step: int) -> bool:
        """Every rank checks its snapshot against its model; all agree, or none uses theirs."""
        problem = shape_mismatch(self.model.state_dict(), state["model"], "model") or self._optim_mismatch(state)
        if self._agree(problem is None):
            return True
        self.log(f"in-memory snapshot of step {step} does not fit this model ({problem or 'on another rank'}); "
                 "trying persistent checkpoints")
        return False

    def _restore_from_peer(self, step: int, holders: list[bool]) -> int | None:
        """In each set of peers the lowest rank holding ``step`` whole sends model and optimizer state
        (and ``model_state``) to the ranks without it. Those keep their own data position and RNG of
        ``step`` where their partial snapshot has them (exact), else start them fresh (a node that
        just joined)."""
        snap, owner = self._snapshot, next(rank for rank in self._peers if holders[rank])
        mine = snap.read(step) if holders[self.rank] and snap is not None else None
        part = snap.read(step, partial=True) if mine is None and snap is not None \
            and step in snap.steps(partial=True) else None
        sent = {"model": mine["model"], "optim": mine["optim"], "shared": mine["shared"]} \
            if self.rank == owner and mine else None
        shared = [sent]
        if not all(holders[rank] for rank in self._peers):
            dist.broadcast_object_list(shared, src=owner, group=self._peer_group)
        state = mine or {**shared[0], "extra": None, "rng": None}
        if not self._fits(state, step):
            return None
        if mine is not None:
            self._apply_local(mine)
        else:
            self.model.load_state_dict(state["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(state["optim"])
            self._load_shared(state)
            if part is not None:
                for name, obj in self.extra.items():
                    load_extra(obj, part["extra"][name])
                set_rng_state(part["rng"])
        source = "own" if mine is not None else f"rank {owner}'s" + (" with its own data position" if part else "")
        self.restored_from = f"in-memory snapshot of step {step} ({source})"
        self.log(f"resumed from the in-memory snapshot of step {step}, model and optimizer sent by a peer holding "
                 f"it to ranks without it (rank {owner} to rank {self.rank}'s peers)")
        return step

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

    def _restore_persistent(self) -> int | None:
        if self.rank == 0:
            persist.remove_stale_tmp(self.root)
        listing = [persist.complete_checkpoints(self.root) if self.rank == 0 else None]
        dist.broadcast_object_list(listing, src=0, group=self._group)
        mismatches = []
        for step, path in listing[0] or []:
            problem = persist.verify(path) if self.rank == 0 else None
            shared = [problem]
            dist.broadcast_object_list(shared, src=0, group=self._group)
            if shared[0] is not None:
                self.log(f"skipping checkpoint {path}: {shared[0]}")
                continue
            state = self._dcp_state(step)
            try:
                persist.load(state, path, self._group)
            except (Exception, CheckpointException) as exc:  # every rank gets the same error from DCP
                mismatches.append(f"{path.name}: {persist.reason(exc)}")
                self.log(f"skipping checkpoint {path}: cannot be loaded into this model ({mismatches[-1]})")
                continue
            set_state_dict(self.model, self.optimizer or [], model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            mine = state.get(f"rank{self.rank}")
            if mine is not None:
                self._load_shared(mine)
                for name, obj in self.extra.items():
                    load_extra(obj, mine["extra"][name])
                set_rng_state(mine["rng"])
            self.restored_from = f"persistent checkpoint {path}"
            self.log(f"resumed from persistent checkpoint {path} (step {step})")
            return step
        if mismatches:
            raise CheckpointError(f"no checkpoint under {self.root} fits this model ({'; '.join(mismatches)}); "
                                  "use a new run dir or restore the model definition")
        return None
