"""Taking in-memory snapshots: after a finished step, this rank's state goes into its two-slot segment.

A slot is committed *partial* at once with everything that a later forward may change, and
parameters and optimizer state (which only ``optimizer.step()`` changes) follow on a background
copy, after which it is marked complete. The round fence is asked once, before the slot is
committed: the copy then completes a step the round committed, even if the round ends meanwhile.
When shared memory cannot hold the slots, snapshots are turned off, said once with what still
protects progress (once per rank and round: under an agent by the master, which prints the recorded event),
and training goes on. The segment's format is ``slots.py``; choosing and
loading a step at restore is ``peers.py``. CUDA tensors go by DMA on a side stream (``cuda_copy.py``):
``optimizer.step()`` then makes the GPU wait for those copies, not the host.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from convoy.errors import CheckpointError
from convoy.runtime.checkpoint_state import BackgroundCopy
from convoy.runtime.cuda_copy import CudaCopies, split_by_device
from convoy.runtime.fence import Fence
from convoy.runtime.slots import HEADER_SIZE, SnapshotFile, SnapshotNoSpace, free_bytes, place
from convoy.worker import events as worker_events

SLACK = 1 << 16
"""Room left in a slot beyond the state's real size, so that a skeleton that grows a little does not regrow it."""


class RankSnapshots:
    """One rank's snapshots in its segment (``file``; None: no convoy agent, or snapshots turned off).

    ``capture(step)`` gives the state to save, ``stable()`` the storage that only ``optimizer.step()``
    changes (copied in the background when ``background``), ``fallback`` what protects progress once
    snapshots are off (said with the reason; ``say_events`` False: only recorded, where the master prints what is
    recorded). The caller waits for ``copies`` before each call that writes or drops the segment (``take``,
    ``check_space``, ``disable``): the background copy writes into it."""

    def __init__(self, file: SnapshotFile | None, *, rank: int, capture: Callable[[int], dict[str, Any]],
                 stable: Callable[[], set[int]], copies: BackgroundCopy, fence: Fence, say: Callable[[str], None],
                 fallback: str, background: bool = True, say_events: bool = True) -> None:
        self.file, self.rank, self.fallback, self.background = file, rank, fallback, background
        self.say_events = say_events
        self._capture, self._stable, self._copies, self._fence, self._say = capture, stable, copies, fence, say
        self._seq = max((slot[0] for slot in file.slots()), default=0) if file is not None else 0
        self._cuda: CudaCopies | None = None  # made on the first snapshot holding CUDA tensors

    @property
    def enabled(self) -> bool:
        return self.file is not None

    def check_space(self, model_bytes: int) -> None:
        """At construction: turn snapshots off at once if shared memory cannot hold even the model twice."""
        if self.file is None:
            return
        needed = HEADER_SIZE + 2 * (model_bytes + SLACK)
        free = free_bytes(self.file.path.parent) + self.file.size_on_disk()
        if needed > free:
            self.disable(f"two snapshots of this model need {needed / 2**20:.1f} MiB, "
                         f"{self.file.path.parent} has {free / 2**20:.1f} MiB free")

    def take(self, step: int) -> None:
        """Snapshot the finished ``step`` if the round fence allows it (else the previous one stays the newest)."""
        if self.file is None or not self._fence.allows(f"snapshot of step {step}"):
            return
        stable = self._stable() if self.background else set()
        # in the background: what only optimizer.step() changes, and every CUDA tensor (copied on a side stream)
        placed = place(self._capture(step), (lambda t: t.is_cuda or t.data_ptr() in stable) if self.background
                       else None)
        tensors, offsets, data_len, pending = placed.tensors, placed.offsets, placed.data_len, placed.pending
        later = [i for i, t in enumerate(tensors) if t.data_ptr() in stable]
        later_set = set(later)
        host_now, cuda_now = split_by_device(tensors, [i for i in range(len(tensors)) if i not in later_set])
        host_later, cuda_later = split_by_device(tensors, later)
        meta = placed.meta()
        if not self.file.fits(data_len, len(meta)) and not self._grow(data_len + 2 * len(meta) + SLACK):
            return
        file = self.file
        self._seq += 1
        index = file.begin(self._seq)
        landings: list[Callable[[], None]] = []
        guard = None
        try:
            file.write_tensors(index, [tensors[i] for i in host_now], [offsets[i] for i in host_now])
            if cuda_now:  # what the next forward may change: the compute stream waits for these copies at once
                event, landed = self._to_host(file, index, tensors, offsets, cuda_now)
                if self.background:
                    CudaCopies.guard(event)()
                    landings.append(landed)
                else:
                    landed()
            if cuda_later:  # parameters and optimizer state: optimizer.step() waits for these, the host does not
                event, landed = self._to_host(file, index, tensors, offsets, cuda_later)
                landings.append(landed)
                guard = CudaCopies.guard(event) if not host_later else None
            # partial until the background copy lands: this rank's own part of ``step`` is in place
            file.commit_meta(index, self._seq, step, meta, data_len, complete=not pending)
        except OSError as exc:
            raise CheckpointError(f"in-memory snapshot failed: {exc}") from exc
        if not pending:
            return

        def finish() -> None:  # completes a step this round committed, even if the round has ended since
            file.write_tensors(index, [tensors[i] for i in host_later], [offsets[i] for i in host_later])
            for landed in landings:
                landed()
            file.mark_complete(index)

        self._copies.start(finish, "convoy-snapshot", guard=guard)

    def _device_copies(self) -> CudaCopies:
        """The CUDA copier, made on the first snapshot that holds CUDA tensors."""
        if self._cuda is None:
            self._cuda = CudaCopies(self._say)
        return self._cuda

    def _to_host(self, file: SnapshotFile, index: int, tensors: list[torch.Tensor], offsets: list[int],
                 chosen: list[int]) -> tuple[torch.cuda.Event, Callable[[], None]]:
        """Start the CUDA tensors ``chosen`` on their way into slot ``index``: the event and the landing."""
        copies = self.pin_for_device()
        assert file.segment is not None
        targets = file.views(index, [tensors[i] for i in chosen], [offsets[i] for i in chosen])
        staged_at = None if copies.pinned(file.segment) else [offsets[i] for i in chosen]
        return copies.to_host([tensors[i] for i in chosen], targets, staged_at)

    def pin_for_device(self) -> CudaCopies:
        """Page-lock the segment for CUDA (once), so copies between it and a GPU run by DMA; the copier."""
        assert self.file is not None and self.file.segment is not None
        copies = self._device_copies()
        if copies.pin(self.file.segment) and copies.unpin not in self.file.before_unmap:
            self.file.before_unmap.append(copies.unpin)
        return copies

    def to_device(self, sources: list[torch.Tensor],
                  targets: list[torch.Tensor]) -> tuple[Callable[[], None], Callable[[], None]]:
        """Start copying views of this segment into CUDA ``targets`` (a restore); returns ``(landed, guard)``:
        ``landed`` waits for the copies (off the training thread), ``guard`` makes the compute stream wait."""
        event = self.pin_for_device().to_device(sources, targets)
        return event.synchronize, CudaCopies.guard(event)

    def _grow(self, slot_size: int) -> bool:
        """Make room for a larger snapshot; False (snapshots now off) when shared memory cannot hold it."""
        assert self.file is not None
        try:
            self.file.allocate(slot_size)
        except SnapshotNoSpace as exc:
            self.disable(str(exc))
            return False
        return True

    def disable(self, why: str) -> None:
        """Say once why in-memory snapshots stop, record it, drop the segment; training goes on."""
        assert self.file is not None
        self.file.remove()
        self.file = None
        self.say_event("snapshot_disabled", f"in-memory snapshots turned off on rank {self.rank}: {why}; "
                                            f"{self.fallback}")

    def say_event(self, kind: str, message: str) -> None:
        """An event of the job (the master prints it), said here too where no master does."""
        if self.say_events:
            self._say(message)
        worker_events.emit(kind, message)

    def held(self) -> tuple[list[int], list[int]]:
        """Steps held whole and steps held at least partially, newest first; unreadable slots are said."""
        if self.file is None:
            return [], []
        if self.file.unreadable():
            self._say(f"rank {self.rank}: ignoring unreadable in-memory snapshots: {'; '.join(self.file.unreadable())}")
        return self.file.steps(), self.file.steps(partial=True)

    def read(self, step: int, copy: bool = True, partial: bool = False) -> Any:
        """The state of ``step`` from this rank's segment (see ``SnapshotFile.read``)."""
        assert self.file is not None
        return self.file.read(step, copy=copy, partial=partial)

    def has_partial(self, step: int) -> bool:
        return self.file is not None and step in self.file.steps(partial=True)
