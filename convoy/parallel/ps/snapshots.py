"""A parameter server's snapshots of its shard, so that a killed server comes back with it.

In memory: a two-slot ``/dev/shm`` segment per PS rank of the job (``runtime/slots.py``'s ``SnapshotFile``: a
kill mid-write leaves the previous snapshot readable; named by ``convoy/shm.py``, so the agent removes it at the
job's end), taken when the chief asks (op ``snapshot``) and once at ``setup``. Persistent: ``save_shard`` to
``RUN_DIR/checkpoints/ps<rank>/shard.pt`` when asked (op ``save``, or ``snapshot`` with ``persist``).

What a snapshot holds: the shard's values and optimizer state at one ``version``, and ``applied``, each worker's
count of pushes in it. Pushes applied after the newest snapshot die with the server; the workers resend them
(``PSClient`` keeps every push the server has not reported kept, ``kept`` here) once the restored server answers,
so no push is lost or applied twice when the server comes back from its in-memory snapshot. Restored from an
older persistent save (its segment gone, e.g. on another node), the pushes between that save and the newest
in-memory snapshot are lost; the workers count them (``PSClient.lost``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from convoy.errors import CheckpointError
from convoy.parallel.ps.server import ParameterServer, save_shard, saved_form, server_from_saved
from convoy.runtime.slots import SnapshotFile, encode_meta, flatten, layout
from convoy.shm import segment_path

SET_UP_MARK = "set-up"
"""A file the first snapshot leaves in the save directory: this rank was set up, so a restart that finds nothing
to take back has lost its shard (without it, the rank was never set up and starts empty)."""
SLACK = 1 << 16
"""Room in a slot beyond the shard's size, for a skeleton that grows (more workers in ``applied``)."""
PERSISTENT_FILE = "shard.pt"


class NoShardToRestore(CheckpointError):
    """A server told to come back with its shard found neither an in-memory snapshot nor a persistent save."""


@dataclass(frozen=True)
class Restored:
    """Where a restored server's shard came from."""

    server: ParameterServer
    source: str
    """``in-memory snapshot`` or ``persistent save``."""
    path: Path


class ShardSnapshots:
    """One PS rank's in-memory snapshot segment (``segment``) and persistent save directory (``directory``;
    None: no persistent saves). ``kept`` is each worker's pushes in the newest in-memory snapshot taken or
    restored: what a kill cannot take away."""

    def __init__(self, segment: Path, directory: Path | None = None) -> None:
        self.segment, self.directory = segment, directory
        self.file = SnapshotFile(segment)
        self.kept: dict[str, int] = {}
        self._seq = max((slot[0] for slot in self.file.slots()), default=0)
        self._marked = False

    @staticmethod
    def for_rank(job_id: str, rank: int, run_dir: Path) -> ShardSnapshots:
        """The segment and save directory of PS ``rank`` of a convoy job."""
        return ShardSnapshots(segment_path(job_id, f"ps{rank}"), Path(run_dir) / "checkpoints" / f"ps{rank}")

    @property
    def persistent(self) -> Path | None:
        return self.directory / PERSISTENT_FILE if self.directory is not None else None

    def take(self, server: ParameterServer) -> int:
        """Write the shard into the older slot (pushes wait meanwhile) and return the version it holds."""
        with server.changed:
            saved = saved_form(server, copy=False)
            tensors: list[torch.Tensor] = []
            skeleton = flatten(saved, tensors)
            offsets, data_len = layout(tensors)
            meta = encode_meta(skeleton, offsets)
            if not self.file.fits(data_len, len(meta)):
                self.file.allocate(data_len + 2 * len(meta) + SLACK)
            self._seq += 1
            index = self.file.begin(self._seq)
            self.file.write_tensors(index, tensors, offsets)
            self.file.commit_meta(index, self._seq, server.version, meta, data_len, complete=True)
            self.kept = dict(server.applied)
        self._mark_set_up()
        return server.version

    def _mark_set_up(self) -> None:
        if self.directory is None or self._marked:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / SET_UP_MARK).touch()
        self._marked = True

    def save(self, server: ParameterServer) -> Path:
        """A persistent save of the shard (atomic: a reader sees the previous file or this one)."""
        if self.persistent is None:
            raise CheckpointError(f"parameter server {server.index} has no directory for persistent saves; give "
                                  "ShardSnapshots one (a convoy job's is RUN_DIR/checkpoints/ps<rank>)")
        save_shard(server, self.persistent)
        return self.persistent

    def restore(self, say: Callable[[str], None] = print) -> Restored | None:
        """The server from the newest readable in-memory snapshot, else from the persistent save; None for a rank
        that was never set up (restarted before its chief's setup reached it: it starts empty); a
        ``NoShardToRestore`` naming both places when a rank that was set up finds neither."""
        for problem in self.file.unreadable():
            say(f"ignoring an unreadable in-memory snapshot in {self.segment}: {problem}")
        steps = self.file.steps()
        if steps:
            server = server_from_saved(self.file.read(steps[0]))
            self.kept = dict(server.applied)
            return Restored(server, "in-memory snapshot", self.segment)
        if self.persistent is not None and self.persistent.is_file():
            server = server_from_saved(torch.load(self.persistent, weights_only=True))
            self.kept = dict(server.applied)
            return Restored(server, "persistent save", self.persistent)
        if self.directory is not None and not (self.directory / SET_UP_MARK).exists():
            return None
        where = f" nor a persistent save at {self.persistent}" if self.persistent is not None else ""
        raise NoShardToRestore(f"this parameter server was restarted to take back its shard, but there is no "
                               f"in-memory snapshot in {self.segment}{where}; the shard is lost: start the job "
                               "again (the chief snapshots the servers at setup and every few steps)")

    def close(self) -> None:
        self.file.close()
