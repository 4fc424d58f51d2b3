"""The in-group phases of the hierarchical allreduce through shared memory, for groups on one machine.

gloo moves every byte between two processes of one host through the kernel's TCP stack: a reduce
and a broadcast of S bytes over k local ranks cost several copies of S per rank, on the same
cores that drive the slow link. Here the ranks of a group map one shared file instead:

    in-slots   k x C bytes: rank r copies chunk t of its tensor into slot r;
    sum-slots  D x C bytes: local rank j adds share j of every in-slot into sum-slot t mod D;
    then the chunk's sum crosses to the other groups (leader: the whole sum, from the leader;
    reduce_scatter: share j, from local rank j), and once it is back every rank copies it out.

A chunk's crossing overlaps the in-host work on the next ``D - 1`` chunks; two barriers of the
group per chunk order the steps (slot reuse is safe because a slot's readers all passed the
barrier before its next writer). A barrier is a counter per rank in the file that each rank
bumps and then waits, yielding the CPU, until every counter has caught up: no network round, where
a gloo barrier takes one (benchmarks/allreduce.py measures both).

The file is made by the group's leader, checked by every member (a random token: members on
another machine, or with a private /dev/shm, can't read it, and every group falls back to
gloo), and unlinked once all have mapped it, so nothing is left in /dev/shm whatever happens
to the processes later.

Only CPU tensors on gloo take this path (``reduce_path``): the segment is CPU memory, which NCCL
can't read, so CUDA tensors keep to the process group's own calls.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from convoy.errors import ConfigError
from convoy.shm import SHM_DIR

ALIGN = 64
DEPTH = 8
"""Sum-slots: a chunk's crossing may lag its in-host reduction by up to ``DEPTH - 1`` chunks (8, not 4:
a coded crossing has CPU work at both ends, which a deeper lag hides; plain crossings are unchanged)."""
RAMP_FROM_CHUNKS = 4
"""Tensors longer than this many chunks start with smaller ones (``chunk_sizes``)."""
DISABLE_ENV = "CONVOY_ALLREDUCE_SHM"
"""Set to ``0`` to keep the in-group phases on gloo."""
SPIN_TIMEOUT_S = 600.0
STORE_ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
"""x86 keeps stores in order (the data a rank wrote is visible before its counter), so the counters alone can
order the steps; elsewhere the group's gloo barrier does (slower, a network round per step)."""


HOST_MEMORY, GROUP = "host_memory", "group"
"""The two ways ``reduce_path`` can send a tensor's in-group phases."""


def device_backend(backend: str, device_type: str) -> str | None:
    """Which backend of a process group reduces tensors on ``device_type``, from the group's backend
    name as ``dist.get_backend`` gives it ("gloo", "nccl", "cpu:gloo,cuda:nccl"); None where none does
    (convoy keeps gloo to CPU tensors and nccl to CUDA ones)."""
    name = backend.lower()
    if ":" in name:
        pairs = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        return pairs.get(device_type)
    if name == "gloo":
        return name if device_type == "cpu" else None
    if name == "nccl":
        return name if device_type == "cuda" else None
    return name


def reduce_path(backend: str, device_type: str) -> str:
    """How the in-group phases move a tensor on ``device_type``: ``HOST_MEMORY`` for CPU tensors on
    gloo, ``GROUP`` (the process group's own calls) for everything else; ``ConfigError`` where the
    group has no backend for that device (a CPU tensor under nccl)."""
    reducer = device_backend(backend, device_type)
    if reducer is None and device_type == "cpu":
        raise ConfigError(f"the process group's backend {backend} reduces CUDA tensors, not CPU ones: move the "
                          "tensor to the GPU (tensor.cuda()), or init the process group with backend "
                          "'cpu:gloo,cuda:nccl' so that CPU tensors go through gloo")
    if reducer is None:
        raise ConfigError(f"the process group's backend {backend} reduces CPU tensors; this one is on "
                          f"{device_type}: move it with tensor.cpu(), or use backend 'nccl' for CUDA tensors")
    return HOST_MEMORY if reducer == "gloo" and device_type == "cpu" else GROUP


class HostSegment:
    """A shared-memory file mapped by every rank of one group: ``k`` in-slots and ``DEPTH`` sum-slots."""

    def __init__(self, memory: mmap.mmap, ranks: int, slot_bytes: int, local: int, intra: Any) -> None:
        self.memory, self.ranks, self.slot_bytes, self.local, self.intra = memory, ranks, slot_bytes, local, intra
        self.bytes = torch.frombuffer(memory, dtype=torch.uint8)
        self.base = HostSegment.header(ranks)
        self.counters = self.bytes[ALIGN:ALIGN + ranks * ALIGN].view(torch.int64).view(ranks, ALIGN // 8)[:, 0]
        self.epoch = 0

    @staticmethod
    def header(ranks: int) -> int:
        """The file's first bytes: the token members check, then one barrier counter per rank, a cache line each."""
        return -(-ALIGN * (ranks + 1) // 4096) * 4096

    @staticmethod
    def size(ranks: int, slot_bytes: int) -> int:
        return HostSegment.header(ranks) + (ranks + DEPTH) * slot_bytes

    def barrier(self) -> None:
        """Every rank of the group has reached this step (and its writes before it are visible)."""
        if not STORE_ORDERED:
            dist.barrier(group=self.intra)
            return
        self.epoch += 1
        self.counters[self.local] = self.epoch
        began, spins = time.monotonic(), 0
        while int(self.counters.min()) < self.epoch:
            spins += 1
            if spins < 64:
                os.sched_yield()
            else:
                time.sleep(20e-6)
                if spins % 4096 == 0 and time.monotonic() - began > SPIN_TIMEOUT_S:
                    raise RuntimeError(f"a rank of this host's group did not reach the allreduce step within "
                                       f"{SPIN_TIMEOUT_S:.0f} s (did a process die?)")

    def _slot(self, index: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        start = self.base + index * self.slot_bytes
        return self.bytes[start:start + count * dtype.itemsize].view(dtype)

    def in_slot(self, rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        return self._slot(rank, count, dtype)

    def sum_slot(self, chunk: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        return self._slot(self.ranks + chunk % DEPTH, count, dtype)


def open_segment(intra: Any, leader: int, members: tuple[int, ...], rank: int, slot_bytes: int,
                 directory: Path = SHM_DIR, world: Any = None) -> HostSegment | None:
    """Collective over every rank of ``world`` (a group of the whole job; None: the default group): map
    one segment per group with more than one rank. Returns the segment on every rank, or None on every
    rank when any group can't share memory (or ``CONVOY_ALLREDUCE_SHM=0``), so all groups run the same
    algorithm. Call it only where gloo reduces CPU tensors (``reduce_path``)."""
    slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
    size = HostSegment.size(len(members), slot_bytes)
    wanted = os.environ.get(DISABLE_ENV, "1") != "0" and len(members) > 1
    path, memory, made = None, None, False
    offer: list[Any] = [None, None]
    if wanted and rank == leader:
        path = directory / f"convoy-allreduce-{os.getpid()}-{secrets.token_hex(8)}"
        token = secrets.token_bytes(16)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            made = True
            try:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first touch
                memory = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            memory[:16] = token
            offer = [str(path), token]
        except OSError:
            memory = None
    if len(members) > 1:
        dist.broadcast_object_list(offer, src=leader, group=intra)
    if wanted and rank != leader and offer[0] is not None:
        try:
            fd = os.open(offer[0], os.O_RDWR)
            try:
                memory = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            if memory[:16] != offer[1]:
                memory.close()
                memory = None
        except (OSError, ValueError):
            memory = None
    ok = torch.tensor([1 if memory is not None or len(members) == 1 else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=world)  # every member has mapped (or failed) before the name goes
    if made and path is not None:
        path.unlink(missing_ok=True)
    if not ok.item() or len(members) == 1:
        if memory is not None:
            memory.close()
        return None
    return HostSegment(memory, len(members), slot_bytes, members.index(rank), intra)


def host_allreduce(flat: torch.Tensor, segment: HostSegment, cross: Callable[[torch.Tensor], Any] | None,
                   crossing: str, chunk_elements: int) -> None:
    """Sum ``flat`` over every rank: in-group through ``segment``, across groups by ``cross`` (an async
    sum of the chunk over the leaders for ``crossing="leader"``, else over this local index's shard
    group, returning a handle to wait on; None when there is one group). The chunks
    (``chunk_sizes``) match the gloo leader algorithm's."""
    k, local, dtype = segment.ranks, segment.local, flat.dtype
    chunks = list(flat.split(chunk_sizes(flat.numel(), chunk_elements)))
    pending: dict[int, Any] = {}
    lag = DEPTH - 1

    def share(count: int) -> tuple[int, int]:
        return local * count // k, (local + 1) * count // k

    def copy_out(t: int) -> None:
        chunks[t].copy_(segment.sum_slot(t, chunks[t].numel(), dtype))

    for t, chunk in enumerate(chunks):
        count = chunk.numel()
        if t >= lag and t - lag in pending:
            pending.pop(t - lag).wait()
        segment.in_slot(local, count, dtype).copy_(chunk)
        segment.barrier()  # chunk t is in every in-slot; chunk t - lag is back from across
        if t >= lag:
            copy_out(t - lag)
        start, stop = share(count)
        total = segment.sum_slot(t, count, dtype)[start:stop]
        torch.add(segment.in_slot(0, count, dtype)[start:stop], segment.in_slot(1, count, dtype)[start:stop],
                  out=total)
        for other in range(2, k):
            total.add_(segment.in_slot(other, count, dtype)[start:stop])
        segment.barrier()  # sum-slot t is complete; the in-slots may be overwritten
        if cross is None:
            continue
        if crossing == "leader" and local == 0:
            pending[t] = cross(segment.sum_slot(t, count, dtype))
        elif crossing == "reduce_scatter":
            pending[t] = cross(total)
    for t in range(max(len(chunks) - lag, 0), len(chunks)):  # each of the last chunks out as soon as it is back
        if t in pending:
            pending.pop(t).wait()
        segment.barrier()
        copy_out(t)


def chunk_sizes(count: int, chunk_elements: int) -> list[int]:
    """How ``host_allreduce`` cuts ``count`` elements: chunks of ``chunk_elements``, except that a long
    tensor starts with a quarter and a half chunk, so its first crossing starts sooner (the pipeline fills
    in a quarter of the time)."""
    sizes = []
    if count > RAMP_FROM_CHUNKS * chunk_elements:
        sizes = [size for size in (chunk_elements // 4, chunk_elements // 2) if size > 0]
    left = count - sum(sizes)
    sizes += [chunk_elements] * (left // chunk_elements)
    if left % chunk_elements:
        sizes.append(left % chunk_elements)
    return sizes
