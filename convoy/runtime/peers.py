"""Resuming from the ranks' in-memory snapshots: which step, and who takes what from whom.

The choice of step is pure (``choose_step``, from what every rank reported holding);
``SnapshotRestore`` loads it: from the rank's own slot, from a peer that holds the step
(replicated state), or, when the ranks share no step at all, each from what it holds
(``_restore_apart``). Every rank makes the same collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from convoy.runtime.checkpoint_state import BackgroundCopy, Restored, TrainingState
from convoy.runtime.cuda_copy import has_cuda
from convoy.runtime.slots import map_leaves
from convoy.runtime.snapshot import RankSnapshots
from convoy.worker import events as worker_events


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
    """Resumes the ranks from their in-memory snapshots (collective over ``group``).

    ``peer_sets`` partition the ranks into sets whose model and optimizer state are interchangeable;
    ``peer_group`` is this rank's set's group (``group`` when there is one set). ``newest_persistent``
    (asked on rank 0) gives the step of the newest persistent checkpoint, which wins when as new."""

    def __init__(self, snapshots: RankSnapshots, state: TrainingState, *, rank: int, world_size: int,
                 peer_sets: list[tuple[int, ...]], group: dist.ProcessGroup, peer_group: dist.ProcessGroup,
                 copies: BackgroundCopy, log: Callable[[str], None],
                 newest_persistent: Callable[[], int | None]) -> None:
        self.snapshots, self.state, self.rank, self.world_size = snapshots, state, rank, world_size
        self.peer_sets, self.group, self.peer_group = peer_sets, group, peer_group
        self.peers = next(peers for peers in peer_sets if rank in peers)
        self._copies, self.log, self._newest_persistent = copies, log, newest_persistent

    def restore(self) -> Restored | None:
        """Pick the step to resume from what every rank holds in shared memory, and load it.

        A snapshot is *whole* once its background copy landed, *partial* before (only the rank's
        own data position and RNG are certain); a worker killed while its copy was in flight loses
        no finished step, ranks without the chosen step take a peer's (``choose_step``)."""
        held = self.snapshots.held()
        newest = self._newest_persistent() if self.rank == 0 else None
        every: list[tuple[list[int], list[int], int | None]] = [([], [], None) for _ in range(self.world_size)]
        dist.all_gather_object(every, (*held, newest), group=self.group)
        whole, some = [set(w) for w, _, _ in every], [set(p) for _, p, _ in every]
        choice = choose_step(whole, some, self.peer_sets, every[0][2])
        if choice is None:
            return None
        if choice.apart:
            return self._restore_apart(choice.step, whole)
        if all(choice.step in w for w in whole):
            return self._restore_own(choice.step)
        return self._restore_from_peer(choice.step, [choice.step in w for w in whole])

    def _agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _fits(self, state: dict[str, Any], step: int) -> bool:
        """Every rank checks its snapshot against its model; all agree, or none uses theirs."""
        problem = self.state.mismatch(state)
        if self._agree(problem is None):
            return True
        self.log(f"in-memory snapshot of step {step} does not fit this model ({problem or 'on another rank'}); "
                 "trying persistent checkpoints")
        return False

    def _restore_own(self, step: int) -> Restored | None:
        views = self.snapshots.read(step, copy=False)
        if not self._fits(views, step):
            return None
        self._apply_views(views)
        self.log(f"resumed from the in-memory snapshot of step {step}")
        return Restored(step, f"in-memory snapshot of step {step}")

    def _apply_views(self, views: dict[str, Any]) -> None:
        """``TrainingState.apply`` from views into shared memory, copying each byte once: load_state_dict
        copies the model's tensors into its parameters and buffers; extras and RNG are small and cloned;
        the optimizer adopts empty tensors that a background copy fills while the first step computes
        (the optimizer's pre-step hook waits for it, as it does for a snapshot's copy)."""
        small = {key: map_leaves(views[key], torch.Tensor, torch.Tensor.clone) for key in ("extra", "shared", "rng")}
        optimizer = self.state.optimizer
        if optimizer is None:
            self.state.apply({**views, **small})
            return
        saved = views["optim"].get("state", {})
        if has_cuda(self.state.model.state_dict()):
            self.snapshots.pin_for_device()  # the model's and optimizer's copies from the segment then run by DMA
        params = self.state.optimizer_params()
        # made where the optimizer keeps them (a GPU's moments on the GPU), so loading them moves no bytes
        def empty_for(index: int, value: Any) -> Any:
            device = params[index].device
            return map_leaves(value, torch.Tensor,
                              lambda t: torch.empty_like(t, device=device if t.dim() else t.device))

        empty = {**views["optim"], "state": {
            index: {name: empty_for(index, value) for name, value in param_state.items()}
            for index, param_state in saved.items()}}
        self.state.apply({"model": views["model"], "optim": empty, **small})
        pairs = [(optimizer.state[params[index]][name], value) for index, param_state in saved.items()
                 for name, value in param_state.items() if isinstance(value, torch.Tensor)]
        host = [(live, value) for live, value in pairs if live.device.type != "cuda"]
        cuda = [(live, value) for live, value in pairs if live.device.type == "cuda"]
        landed, guard = (self.snapshots.to_device([value for _, value in cuda], [live for live, _ in cuda])
                         if cuda else (None, None))

        def fill() -> None:
            for live, value in host:
                live.copy_(value)
            if landed is not None:
                landed()

        self._copies.start(fill, "convoy-restore", guard=guard if not host else None)

    def _restore_from_peer(self, step: int, holders: list[bool]) -> Restored | None:
        """In each set of peers the lowest rank holding ``step`` whole sends model and optimizer state
        (and ``model_state``) to the ranks without it. Those keep their own data position and RNG of
        ``step`` where their partial snapshot has them (exact), else start them fresh (a node that
        just joined)."""
        snaps, owner = self.snapshots, next(rank for rank in self.peers if holders[rank])
        mine = snaps.read(step) if holders[self.rank] and snaps.enabled else None
        part = snaps.read(step, partial=True) if mine is None and snaps.has_partial(step) else None
        sent = {"model": mine["model"], "optim": mine["optim"], "shared": mine["shared"]} \
            if self.rank == owner and mine else None
        shared = [sent]
        if not all(holders[rank] for rank in self.peers):
            dist.broadcast_object_list(shared, src=owner, group=self.peer_group)
        state = mine or {**shared[0], "extra": None, "rng": None}
        if not self._fits(state, step):
            return None
        if mine is not None:
            self.state.apply(mine)
        else:
            self.state.apply_replicated(state)
            if part is not None:
                self.state.apply_own(part)
        source = "own" if mine is not None else f"rank {owner}'s" + (" with its own data position" if part else "")
        self.log(f"resumed from the in-memory snapshot of step {step}, model and optimizer sent by a peer holding "
                 f"it to ranks without it (rank {owner} to rank {self.rank}'s peers)")
        return Restored(step, f"in-memory snapshot of step {step} ({source})")

    def _restore_apart(self, step: int, whole: list[set[int]]) -> Restored | None:
        """No step is held whole by every rank (a node was out of the job for a while): the job resumes
        after ``step``, the newest any rank holds. Ranks holding it load it; each other rank loads its
        own newest snapshot if it fits this model, else keeps its freshly constructed state."""
        own = step if step in whole[self.rank] else max(whole[self.rank], default=None)
        views = self.snapshots.read(own, copy=False) if own is not None and self.snapshots.enabled else None
        problem = None if views is None else self.state.mismatch(views)
        if not self._agree(not (own == step and problem)):
            self.log(f"in-memory snapshot of step {step} does not fit this model; trying persistent checkpoints")
            return None
        loaded = own if views is not None and problem is None else None
        if loaded is not None:
            self._apply_views(views)  # type: ignore[arg-type]
        sources: list[int | None] = [None] * self.world_size
        dist.all_gather_object(sources, loaded, group=self.group)
        if self.rank == 0:
            parts = [f"rank {rank} from step {src}" if src is not None else f"rank {rank} keeps its fresh state"
                     for rank, src in enumerate(sources)]
            message = (f"the ranks share no in-memory snapshot step: the job resumes at step {step + 1}, after the "
                       f"newest step any rank holds ({', '.join(parts)})")
            self.log(message)
            worker_events.emit("resumed_apart", message)
        return Restored(step, f"in-memory snapshot of step {loaded} (own; the job resumes after step {step})"
                        if loaded is not None else f"fresh state (the job resumes after step {step})")
