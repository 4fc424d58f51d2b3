"""The replay buffer's in-memory snapshots, so that a killed buffer comes back with what it held.

A two-slot ``/dev/shm`` segment per replay rank (``runtime/slots.py``'s ``SnapshotFile``: a kill mid-write leaves
the previous snapshot readable; named by ``convoy/shm.py``, so it ends with the job). A snapshot holds the whole
ring and its counters, among them each actor's count of transitions in it: an actor keeps what it inserted
after the count the buffer last reported kept, and sends it again to a restored buffer, so a restart loses
nothing that an actor still holds (an actor that died with the buffer loses what it had not seen kept: counted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from convoy.runtime.slots import SnapshotFile, encode_meta, flatten, layout
from convoy.shm import segment_path
from convoy.workloads.rl.buffer import ReplayBuffer

SLACK = 1 << 16
"""Room in a slot beyond the buffer's size, for counters that grow (more actors)."""


class BufferSnapshots:
    """One replay rank's segment; ``kept`` is each source's transitions in the newest snapshot taken or restored."""

    def __init__(self, segment: Path) -> None:
        self.segment = segment
        self.file = SnapshotFile(segment)
        self.kept: dict[str, int] = {}
        self.taken = 0
        self._seq = max((slot[0] for slot in self.file.slots()), default=0)

    @staticmethod
    def for_rank(job_id: str, rank: int) -> BufferSnapshots:
        return BufferSnapshots(segment_path(job_id, f"replay{rank}"))

    def take(self, buffer: ReplayBuffer, extra: dict[str, Any] | None = None) -> int:
        """Write the buffer (and ``extra``: plain values the service keeps beside it) into the older slot; the
        caller holds the buffer still. Returns its insert count."""
        saved = {"buffer": buffer.saved_form(), "extra": extra or {}}
        tensors: list[torch.Tensor] = []
        skeleton = flatten(saved, tensors)
        offsets, data_len = layout(tensors)
        meta = encode_meta(skeleton, offsets)
        if not self.file.fits(data_len, len(meta)):
            # room for the full ring at once: the slot is not grown again as the buffer fills
            full = buffer.capacity * buffer.layout.row_bytes + buffer.capacity * 16
            self.file.allocate(max(full, data_len) + 2 * len(meta) + SLACK)
        self._seq += 1
        index = self.file.begin(self._seq)
        self.file.write_tensors(index, tensors, offsets)
        self.file.commit_meta(index, self._seq, self._seq, meta, data_len, complete=True)
        self.kept = dict(buffer.counters.by_source)
        self.taken += 1
        return buffer.counters.inserted

    def restore(self, seed: int = 0) -> tuple[ReplayBuffer, dict[str, Any]] | None:
        """The buffer of the newest readable snapshot and what was kept beside it; None when there is none."""
        steps = self.file.steps()
        if not steps:
            return None
        saved = self.file.read(steps[0])
        buffer = ReplayBuffer.from_saved(saved["buffer"], seed=seed)
        self.kept = dict(buffer.counters.by_source)
        return buffer, dict(saved["extra"])

    def problems(self) -> list[str]:
        return self.file.unreadable()

    def close(self) -> None:
        self.file.close()
