"""Resuming from the ranks' in-memory snapshots: which step, and who takes what from whom.

The choice of step is pure (``choose_step``, from what every rank reported holding); the
``SnapshotRestore`` half of the Checkpointer loads it: from the rank's own slot, from a peer
that holds the step (replicated state), or, when the ranks share no step at all, each from what
it holds (``_restore_apart``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from convoy import worker_events
from convoy.runtime.checkpoint_state import load_extra, set_rng_state, shape_mismatch
from convoy.runtime.snapshot import SnapshotFile, map_leaves


@dataclass(frozen=True)
class StepChoice:
    """``step`` to resume after; ``apart``: the ranks share no step, so each loads what it holds."""

    step: int
    apart: bool = False


def choose_step(whole: list[set[int]], some: list[set[int]], peer_sets: list[tuple[int, ...]],
                newest_persistent: int | None) -> StepChoice | None:
    """A step is *covered* when every set of peers has a rank holding it whole. The newest covered
    step that every rank holds at least partially wins, else the newest covered one. Without
    peers, when no step is covered, the newest step any rank holds whole: ranks that were out of
    the job for a while hold only older steps. A persistent checkpoint wins instead when it is as
    new, or when some rank holds no snapshot at all (its own state would be lost to a fresh one)."""
    covered = {step for step in set().union(*whole)
               if all(any(step in whole[rank] for rank in peers) for peers in peer_sets)}
    candidates = set.intersection(*some) & covered or covered
    if candidates:
        return StepChoice(max(candidates))
    held = set().union(*whole)
    alone = all(len(peers) == 1 for peers in peer_sets)
    if not held or not alone:
        return None
    if newest_persistent is not None and (newest_persistent >= max(held) or not all(whole)):
        return None
    return StepChoice(max(held), apart=True)


class SnapshotRestore:
    """The in-memory half of ``Checkpointer.restore`` (mixed into it; uses its model and groups)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    extra: dict[str, Any]
    shared: dict[str, Any]
    rank: int
    world_size: int
    peer_sets: list[tuple[int, ...]]
    restored_from: str
    log: Callable[[str], None]
    _say: Callable[[str], None]
    _snapshot: SnapshotFile | None
    _group: dist.ProcessGroup
    _peer_group: dist.ProcessGroup
    _peers: tuple[int, ...]
    _copy_thread: threading.Thread | None
    _copy_error: BaseException | None
    _apply_local: Callable[[dict[str, Any]], None]
    _load_shared: Callable[[dict[str, Any]], None]
    _fits: Callable[[dict[str, Any], int], bool]
    _optim_mismatch: Callable[[dict[str, Any]], str | None]
    _agree: Callable[[bool], bool]
    _newest_persistent: Callable[[], int | None]

    def _restore_snapshot(self) -> int | None:
        """Pick the step to resume from what every rank holds in shared memory, and load it.

        A snapshot is *whole* once its background copy landed, *partial* before (only the rank's
        own data position and RNG are certain); a worker killed while its copy was in flight loses
        no finished step, ranks without the chosen step take a peer's (``choose_step``)."""
        snap = self._snapshot
        if snap is not None and snap.unreadable():
            self._say(f"rank {self.rank}: ignoring unreadable in-memory snapshots: {'; '.join(snap.unreadable())}")
        held = (snap.steps(), snap.steps(partial=True)) if snap is not None else ([], [])
        newest = self._newest_persistent() if self.rank == 0 else None
        every: list[tuple[list[int], list[int], int | None]] = [([], [], None) for _ in range(self.world_size)]
        dist.all_gather_object(every, (*held, newest), group=self._group)
        whole, some = [set(w) for w, _, _ in every], [set(p) for _, p, _ in every]
        choice = choose_step(whole, some, self.peer_sets, every[0][2])
        if choice is None:
            return None
        if choice.apart:
            return self._restore_apart(choice.step, whole)
        if all(choice.step in w for w in whole):
            return self._restore_own(choice.step)
        return self._restore_from_peer(choice.step, [choice.step in w for w in whole])

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

    def _restore_apart(self, step: int, whole: list[set[int]]) -> int | None:
        """No step is held whole by every rank (a node was out of the job for a while): the job resumes
        after ``step``, the newest any rank holds. Ranks holding it load it; each other rank loads its
        own newest snapshot if it fits this model, else keeps its freshly constructed state."""
        own = step if step in whole[self.rank] else max(whole[self.rank], default=None)
        views = self._snapshot.read(own, copy=False) if own is not None and self._snapshot is not None else None
        problem = None if views is None else (
            shape_mismatch(self.model.state_dict(), views["model"], "model") or self._optim_mismatch(views))
        if not self._agree(not (own == step and problem)):
            self.log(f"in-memory snapshot of step {step} does not fit this model; trying persistent checkpoints")
            return None
        loaded = own if views is not None and problem is None else None
        if loaded is not None:
            self._apply_snapshot(views)  # type: ignore[arg-type]
        sources: list[int | None] = [None] * self.world_size
        dist.all_gather_object(sources, loaded, group=self._group)
        if self.rank == 0:
            parts = [f"rank {rank} from step {src}" if src is not None else f"rank {rank} keeps its fresh state"
                     for rank, src in enumerate(sources)]
            message = (f"the ranks share no in-memory snapshot step: the job resumes at step {step + 1}, after the "
                       f"newest step any rank holds ({', '.join(parts)})")
            self.log(message)
            worker_events.emit("resumed_apart", message)
        self.restored_from = (f"in-memory snapshot of step {loaded} (own; the job resumes after step {step})"
                              if loaded is not None else f"fresh state (the job resumes after step {step})")
        return step
