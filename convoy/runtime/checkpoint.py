"""``convoy.Checkpointer``: a snapshot after every step in shared memory, async persistent saves,
and an exact resume from whichever is newest and agreed by every rank.

    ckpt = convoy.Checkpointer(model, optimizer, state={"data": sampler}, persist_every=100)
    for step in range(ckpt.restore(), num_steps):
        ...; optimizer.step()
        ckpt.step(step)          # `step` is finished: it will not be redone after a failure
    ckpt.close()

This is the face; the protocols behind it are ``snapshot.py`` (taking in-memory snapshots),
``peers.py`` (agreeing on a step and taking it from a peer) and ``persist.py`` (DCP saves and restore).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from convoy.errors import CheckpointError
from convoy.runtime import persist
from convoy.runtime.checkpoint_state import BackgroundCopy, TrainingState, peer_sets
from convoy.runtime.fence import RoundFence
from convoy.runtime.peers import SnapshotRestore
from convoy.runtime.slots import SnapshotFile
from convoy.runtime.snapshot import RankSnapshots
from convoy.runtime.snapshot_budget import SnapshotBudget
from convoy.runtime.stop_copy import ExitAfterCopy
from convoy.shm import segment_path
from convoy.worker.role_env import GROUP_ENV
from convoy.worker.shards import AGENT_URL_ENV

ROLLBACK_ENV = "CONVOY_RESTORE_AT_MOST"


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
    When ``/dev/shm`` cannot hold the snapshots they are turned off (said once) and persistent
    saves go on; under a convoy agent nothing is committed for a round that is no longer current.
    A SIGTERM (the agent stopping the round) lets a copy in flight land before the worker exits, where
    the script left SIGTERM at its default (``stop_copy.py``).
    ``max_overhead`` (e.g. 0.02) snapshots every k-th step instead, with the smallest k whose measured cost stays
    within that share of the training's time (``snapshot_budget.py``); k and the steps a failure may then cost
    (k - 1 at most) are said in an event and ``convoy status``. None (the default) snapshots every step.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
        state: dict[str, Any] | None = None, every: int = 1, persist_every: int = 0, keep: int = 2,
        directory: str | Path | None = None, async_snapshot: bool = True,
        replicated: bool | Sequence[Sequence[int]] | None = None, model_state: dict[str, Any] | None = None,
        log: Callable[[str], None] | None = None, max_overhead: float | None = None,
    ) -> None:
        if every < 1 or persist_every < 0 or keep < 1:
            raise CheckpointError(
                f"need every >= 1, persist_every >= 0, keep >= 1 (got {every}, {persist_every}, {keep})")
        if max_overhead is not None and every != 1:
            raise CheckpointError(f"give every ({every}) or max_overhead ({max_overhead}), not both: max_overhead "
                                  "chooses how often to snapshot from what a snapshot costs")
        budget = SnapshotBudget(max_overhead) if max_overhead is not None else None
        self.budget: SnapshotBudget | None = None
        self._last_call: tuple[float, bool] | None = None
        """When the last ``step()`` was called and whether it took a snapshot (what the budget measures)."""
        if not dist.is_initialized():
            raise CheckpointError("call convoy.init() (or init_process_group) before creating a Checkpointer")
        self.model, self.optimizer, self.extra = model, optimizer, dict(state or {})
        self.shared = dict(model_state or {})
        clash = sorted(set(self.extra) & set(self.shared))
        if clash:
            raise CheckpointError(f"{clash} named in both state and model_state; give each object once")
        self.state = TrainingState(model, optimizer, self.extra, self.shared)
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
        # a worker must find its own snapshot on its own host; in a role group, by role and role rank (stable)
        node, role_group = os.environ.get("CONVOY_NODE_ID", "node"), os.environ.get(GROUP_ENV, "")
        worker = f"{node}-{role_group}{self.rank}" if role_group else \
            f"{node}-local{os.environ.get('LOCAL_RANK', self.rank)}"
        slot_file = SnapshotFile(segment_path(job_id, worker)) if job_id else None
        self.budget = budget if slot_file is not None else None  # outside a job there are no snapshots to budget
        group, peer_group = self._new_groups()
        self._budget_group = dist.new_group(backend="gloo") if max_overhead is not None else None
        """The ranks' agreement on k, on a group of its own: a persistent save's collectives run on the saves'
        group from a background thread, and two threads' collectives on one group could pair up wrongly."""
        if self._budget_group is not None:
            self._groups.append(self._budget_group)
        peers = next(peers for peers in self.peer_sets if self.rank in peers)
        self._closed = False
        root = Path(directory) if directory else \
            Path(os.environ.get("CONVOY_RUN_DIR", ".")) / "checkpoints" / role_group
        round_id = int(os.environ.get("CONVOY_ROUND", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        self._saver = persist.PersistentSaver(root, group, self.rank, keep, round_id, self.log, self.fence)
        self.root = root
        self.restored_from = "nothing"
        self._copies = BackgroundCopy()
        self._stop_copy = ExitAfterCopy.install(self._copies)
        fallback = (f"persistent saves every {persist_every} steps go on (to {root})" if persist_every
                    else "persist_every is 0, so nothing protects progress now: set persist_every, or give /dev/shm "
                         "more room (e.g. docker --shm-size)")
        self._snapshots = RankSnapshots(
            slot_file, rank=self.rank, capture=self.state.capture, stable=self.state.stable_storage,
            copies=self._copies, fence=self.fence, say=self._say, fallback=fallback, background=async_snapshot,
            say_events=log is not None or not os.environ.get(AGENT_URL_ENV))  # else the master prints the event
        self._persistent = persist.PersistentRestore(root, self.state, rank=self.rank, world_size=self.world_size,
                                                     peers=peers, group=group, log=self.log)
        self._from_snapshots = SnapshotRestore(
            self._snapshots, self.state, rank=self.rank, world_size=self.world_size, peer_sets=self.peer_sets,
            group=group, peer_group=peer_group, copies=self._copies, log=self.log,
            newest_persistent=self._persistent.newest)
        self._snapshots.check_space(self.state.model_bytes())
        if optimizer is not None:
            optimizer.register_step_pre_hook(lambda *args: self._before_change())

    def _new_groups(self) -> tuple[Any, Any]:
        """The gloo group saves and restores use (never the training's), and the one of this rank's peers (the
        same group where every rank is every other's peer); every rank makes every group, in one order."""
        group = dist.new_group(backend="gloo")
        peer_group = group
        if self.replicated and len(self.peer_sets) > 1:
            for ranks in self.peer_sets:
                made = dist.new_group(list(ranks), backend="gloo")
                if self.rank in ranks:
                    peer_group = made
        self._groups = [group] if peer_group is group else [group, peer_group]
        return group, peer_group

    def step(self, step: int) -> None:
        """Record that ``step`` finished: snapshot it (every ``every``-th step, or as ``max_overhead`` allows), and
        persist it when due."""
        self._check_open("step")
        called = time.perf_counter()
        self._wait_copy()
        due = self._budget_due(called) if self.budget is not None else step % self.every == 0
        if self._snapshots.enabled and due:
            self._snapshots.take(step)
        if self.persist_every and (step + 1) % self.persist_every == 0:
            stable = self.state.stable_storage() if self.async_snapshot else set()
            self._saver.save_async(persist.dcp_state(self.state, step, self.rank), step, stable)

    def _budget_due(self, called: float) -> bool:
        """Whether this step is snapshotted under ``max_overhead``; where the budget chooses k again, the ranks
        agree on the largest any of them proposes, and a new k is said (an event, and ``convoy status``)."""
        budget = self.budget
        assert budget is not None
        if self._last_call is not None:
            budget.observe(called - self._last_call[0], self._last_call[1])
        due = budget.due()
        self._last_call = (called, due)
        if budget.deciding():
            agreed = torch.tensor([budget.propose()])
            dist.all_reduce(agreed, dist.ReduceOp.MAX, group=self._budget_group)
            decision = budget.settle(int(agreed.item()))
            if decision is not None and self.rank == 0:
                self._snapshots.say_event("snapshot_interval", decision.describe())
        return due

    def restore(self) -> int:
        """Load the newest state every rank has; return the step to start from (0: fresh).

        In a round that rolls the job back (``CONVOY_RESTORE_AT_MOST``, set by the agent when the training
        manager applies a rollback) the newest persistent checkpoint at or before that step is loaded instead."""
        self._check_open("restore")
        at_most = os.environ.get(ROLLBACK_ENV, "")
        if at_most.isdigit():
            restored = self._persistent.restore(int(at_most))
            if restored is None:
                self.log(f"no persistent checkpoint at or before step {at_most} to roll back to: resuming from the "
                         "newest state instead")
        else:
            restored = None
        if restored is None:
            restored = self._from_snapshots.restore()
        if restored is None:
            restored = self._persistent.restore()
        if restored is None:
            return 0
        self.restored_from = restored.source
        return restored.step + 1

    def _wait_copy(self) -> None:
        """Before the next snapshot: the last one's copy has landed (its slot may be read or marked)."""
        self._saver.wait_staged()
        self._copies.wait()

    def _before_change(self) -> None:
        """Before ``optimizer.step()``: no copy may still read or fill the live tensors (for CUDA copies on a
        side stream the GPU waits for them, the host does not)."""
        self._saver.wait_staged()
        self._copies.before_change()

    def wait(self) -> None:
        """Wait for the background copy and any persistent save in flight (training may go on after)."""
        self._check_open("wait")
        self._wait_copy()
        self._saver.wait()

    def close(self) -> None:
        """Wait for the background copy and any persistent save in flight, then release the checkpoint's
        process groups. Closing twice is harmless; ``step`` and ``restore`` after it are refused."""
        if self._closed:
            return
        self.wait()
        self._copies.close()
        if self._stop_copy is not None:
            self._stop_copy.uninstall()
            self._stop_copy = None
        self._release_groups()
        self._closed = True

    def _release_groups(self) -> None:
        """Destroy the groups made for saves and restores and drop every reference to them, so that torch
        joins their gloo threads now. Left to the interpreter's exit, a gloo thread still releasing the last
        collective's tensors (a restore's all-gather) needs the GIL while the interpreter finalizes, and the
        process aborts ("terminate called without an active exception", SIGABRT) after training finished."""
        groups, self._groups = self._groups, []
        self._budget_group = None
        self._saver.group = self._persistent.group = None  # type: ignore[assignment]
        self._from_snapshots.group = self._from_snapshots.peer_group = None  # type: ignore[assignment]
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except ValueError:  # destroyed already, with the whole world
                pass
        del groups  # the last references: each group's destructor joins its threads, with the GIL released

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CheckpointError(f"Checkpointer.{what}() after close(); make a new Checkpointer to go on")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
