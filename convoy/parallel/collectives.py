"""Hierarchical allreduce over torch.distributed sub-groups, a DDP hook, and the automatic choice.

    comm = HierarchicalAllreduce(Topology.from_env())   # every rank, same order: builds sub-groups
    comm.allreduce(tensor, op="avg")                      # algorithm="auto": the cost model picks
    ddp.register_comm_hook(None, comm.ddp_hook())

Who sends what, and the cost model, live in ``topology.py``; what ``auto`` measures (probes,
trials, the job's cache) in ``autotune.py``; this file makes the calls. Both
hierarchical algorithms cut the tensor into chunks and pipeline them, so the fast in-group
phases of one chunk overlap the slow cross-group phase of another. Where a group's ranks share
a machine, those in-group phases run through shared memory (``host_memory.py``), else on gloo;
with ``compress``, the cross-group phase sends chunks losslessly coded (``float_codec.py``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from queue import Queue
from typing import Any

import torch
import torch.distributed as dist

from convoy.errors import ConfigError
from convoy.parallel.autotune import Trial, cache_file, load_cache, measure, save_cache, trial_rounds
from convoy.parallel.float_codec import CodedSum, codable
from convoy.parallel.host_memory import HostSegment, chunk_sizes, host_allreduce, open_segment
from convoy.parallel.topology import ALGORITHMS, CostModel, Topology, check_algorithm, size_class

OPS = ("sum", "avg")
CHUNK_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


class HierarchicalAllreduce:
    """Allreduce that knows which ranks share fast links. Create it on every rank of the default
    group in the same order (it creates the sub-groups it needs, a collective call).

    ``cost``: what each algorithm costs; by default measured on first use of ``auto`` (the links
    inside a group and among the leaders, then every algorithm end to end, at 1 and 32 MB) and
    cached per job in ``cache_dir`` (default ``$CONVOY_RUN_DIR/collectives``), so a restarted
    round of the same job does not measure again.

    ``host_memory``: where every group's ranks can map one shared-memory file (ranks of one
    machine), the in-group phases run through it instead of gloo (``host_memory.py``); give the
    same value on every rank (``CONVOY_ALLREDUCE_SHM=0`` turns it off job-wide).

    ``tune``: where the cost model finds several algorithms close at a message size, ``auto``
    tries each on the first real calls of that size and keeps the fastest (``choose``).

    ``compress``: for two groups (more are refused), the cross-group phase sends float32, float64 and bfloat16 chunks
    losslessly coded (``float_codec.py``: 7/8, 15/16 and 3/4 of the bytes) for about 2 ms of CPU per
    MB. Worth it where the link between the groups is slow (64 MB over 2 x 2 ranks joined at 1 Gbit/s:
    502 ms against 564), not on fast links; the result is the same to the bit."""

    def __init__(self, topology: Topology | None = None, *, cost: CostModel | None = None,
                 cache_dir: str | Path | None = None, chunk_bytes: int = CHUNK_BYTES, host_memory: bool = True,
                 tune: bool = True, compress: bool = False) -> None:
        if not dist.is_initialized():
            raise ConfigError("call convoy.init() (or init_process_group) before creating a HierarchicalAllreduce")
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1 (got {chunk_bytes})")
        self.topology = topology or Topology.from_env()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.topology.world_size != self.world_size:
            raise ConfigError(f"topology covers {self.topology.world_size} ranks but the process group has "
                              f"{self.world_size}; give one group entry per rank of the job")
        if compress and len(self.topology.groups) > 2:
            raise ConfigError(f"compress=True codes what two groups exchange; this topology has "
                              f"{len(self.topology.groups)} groups (leave compress off)")
        self.chunk_bytes, self.tune = chunk_bytes, tune
        self._cost, self._cost_given = cost, cost is not None
        self._decided: dict[int, str] = {}  # size class -> what auto runs, once a trial has settled it
        self._trials: dict[int, Trial] = {}
        run_dir = os.environ.get("CONVOY_RUN_DIR")
        self.cache_dir = Path(cache_dir) if cache_dir else (Path(run_dir) / "collectives" if run_dir else None)
        groups = self.topology.groups
        index = self.topology.group_of(self.rank)
        self.members = groups[index]
        intra = [dist.new_group(list(group)) for group in groups]
        self._intra = intra[index]
        leaders = dist.new_group(list(self.topology.leaders))
        self._leaders = leaders if self.rank in self.topology.leaders else None
        self._shard = None
        if self.topology.is_uniform:
            shards = [dist.new_group(list(ring)) for ring in self.topology.shard_groups()]
            self._shard = shards[self.topology.local_index(self.rank)]
        self._coded = compress and len(groups) == 2
        self._segment: HostSegment | None = None
        if host_memory:
            self._segment = open_segment(self._intra, self.members[0], self.members, self.rank, max(chunk_bytes, 16))
        self._hook_queue: Queue[Callable[[], None] | None] | None = None

    # --- the public calls ---

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto", check: bool = True) -> str:
        """Reduce ``tensor`` in place across all ranks; returns the algorithm used.

        ``check`` first compares size, dtype, op and algorithm across ranks (one small all-gather)
        and raises ``ConfigError`` on every rank if they differ, before any data moves."""
        self._validate(tensor, op, algorithm)
        if check:
            self._check_same(tensor, op, algorithm)
        nbytes = tensor.numel() * tensor.element_size()
        chosen, trial = self._auto(nbytes) if algorithm == "auto" else (algorithm, None)
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        if trial is not None:
            dist.barrier()  # a trial call times the algorithm, not the ranks' arrival skew
        began = time.perf_counter()
        if chosen == "flat" or self.world_size == 1:
            dist.all_reduce(flat)
        elif chosen == "leader":
            self._leader(flat)
        else:
            self._reduce_scatter(flat)
        if trial is not None:
            trial.record(chosen, time.perf_counter() - began)
            if trial.complete:
                self._settle(nbytes, trial)
        if op == "avg":
            flat.div_(self.world_size)
        if work is not tensor:
            tensor.copy_(work)
        return chosen

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], op: str = "sum", algorithm: str = "auto",
                            bucket_bytes: int = BUCKET_BYTES, check: bool = True) -> None:
        """Reduce a list of tensors in place: flattened into buckets of one dtype, up to ``bucket_bytes`` each."""
        buckets: list[list[torch.Tensor]] = []
        current: dict[torch.dtype, list[torch.Tensor]] = {}
        sizes: dict[torch.dtype, int] = {}
        for tensor in tensors:
            bucket = current.setdefault(tensor.dtype, [])
            if bucket and sizes[tensor.dtype] + tensor.numel() * tensor.element_size() > bucket_bytes:
                buckets.append(bucket)
                bucket = current[tensor.dtype] = []
                sizes[tensor.dtype] = 0
            bucket.append(tensor)
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
        buckets.extend(bucket for bucket in current.values() if bucket)
        for bucket in buckets:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self.allreduce(flat, op, algorithm, check)
            for tensor, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                tensor.copy_(part.view_as(tensor))

    def choose(self, nbytes: int) -> str:
        """What ``auto`` runs for a message of ``nbytes`` (measures the links the first time).

        The cost model's pick, unless a trial settled this size class (sizes within a factor of 2):
        where the model predicts several algorithms within ``TRIAL_WITHIN`` of the fastest, the
        first calls of ``auto`` at that size run them in turn, each after a barrier, and the winner
        stays (``autotune.Trial``): timed at the real size, in the real job, it corrects the probes."""
        if len(self.topology.groups) in (1, self.world_size):
            return "flat"
        decided = self._decided.get(size_class(nbytes))
        return decided or self.cost_model().choose(self.topology, nbytes)

    def settled(self, nbytes: int) -> bool:
        """Whether ``auto`` has stopped trying algorithms at this size: no trial was needed, or it
        ended (measures the links the first time, as ``choose`` does: call it on every rank)."""
        if len(self.topology.groups) in (1, self.world_size) or not self.tune:
            return True
        kind = size_class(nbytes)
        if kind in self._decided or kind in self._trials:
            return kind in self._decided
        return len(self.cost_model().candidates(self.topology, nbytes)) == 1

    def ddp_hook(self, algorithm: str = "auto") -> Callable[[Any, dist.GradBucket], torch.futures.Future]:
        """A DDP communication hook averaging gradients with this allreduce:
        ``model.register_comm_hook(None, comm.ddp_hook())``. Buckets are reduced one at a time on
        a background thread, in the order DDP hands them over (the same on every rank), so the
        backward pass goes on computing while they travel."""
        check_algorithm(algorithm)
        if algorithm == "auto":
            self.choose(1)  # measure now, on the main thread, not inside backward
        queue = self._start_hook_thread()

        def hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP rejects string annotations)
            future: torch.futures.Future = torch.futures.Future()
            buffer = bucket.buffer()

            def run() -> None:
                try:
                    self.allreduce(buffer, "avg", algorithm, check=False)
                    future.set_result(buffer)
                except BaseException as exc:  # noqa: BLE001 (handed to DDP through the future)
                    future.set_exception(exc)

            queue.put(run)
            return future

        return hook

    def close(self) -> None:
        """Stop the DDP hook's thread (sub-groups go with the default group)."""
        if self._hook_queue is not None:
            self._hook_queue.put(None)
            self._hook_queue = None

    def _auto(self, nbytes: int) -> tuple[str, Trial | None]:
        """What this ``auto`` call runs, and the trial it is part of (None once settled)."""
        if len(self.topology.groups) in (1, self.world_size):
            return "flat", None
        kind = size_class(nbytes)
        cost = self.cost_model()  # first: it may load settled classes from the job's cache
        if kind in self._decided:
            return self._decided[kind], None
        if not self.tune:
            return cost.choose(self.topology, nbytes), None
        trial = self._trials.get(kind)
        if trial is None:
            candidates = cost.candidates(self.topology, nbytes)
            if len(candidates) == 1:
                self._decided[kind] = candidates[0]
                return candidates[0], None
            rounds = trial_rounds(sum(cost.predict(self.topology, c, nbytes) for c in candidates))
            trial = self._trials[kind] = Trial(candidates, rounds)
        return trial.next(), trial

    def _settle(self, nbytes: int, trial: Trial) -> None:
        """End a trial (collective: every rank ends it on the same call) and keep its winner."""
        kind = size_class(nbytes)
        self._decided[kind] = trial.settle()
        del self._trials[kind]
        self._save_cache()

    # --- the algorithms ---

    def _chunks(self, flat: torch.Tensor, multiple: int = 1) -> list[torch.Tensor]:
        per_chunk = max(self.chunk_bytes // flat.element_size() // multiple, 1) * multiple
        return list(flat.split(per_chunk))

    @property
    def host_memory(self) -> bool:
        """Whether this rank's group runs its in-group phases through shared memory."""
        return self._segment is not None

    def _through_host(self, flat: torch.Tensor, crossing: str) -> None:
        assert self._segment is not None
        cross = (lambda chunk: self._cross(chunk, crossing)) if len(self.topology.groups) > 1 else None
        host_allreduce(flat, self._segment, cross, crossing, max(self.chunk_bytes // flat.element_size(), 1))

    def _cross(self, chunk: torch.Tensor, crossing: str) -> Any:
        """Start summing ``chunk`` across the groups (over the leaders, or this rank's shard ring); a handle."""
        group = self._leaders if crossing == "leader" else self._shard
        if self._coded and codable(chunk.dtype):
            return CodedSum(chunk, group, self.topology.partner(self.rank, crossing))
        return dist.all_reduce(chunk, group=group, async_op=True)

    def _leader(self, flat: torch.Tensor) -> None:
        """Reduce to the leader, allreduce among leaders, broadcast; chunk by chunk, pipelined."""
        if self._segment is not None:
            self._through_host(flat, "leader")
            return
        leader, local = self.members[0], len(self.members) > 1
        # cut as host_allreduce cuts: a lone rank's group runs this while the others' groups use host memory
        chunks = list(flat.split(chunk_sizes(flat.numel(), max(self.chunk_bytes // flat.element_size(), 1))))
        reduces = [dist.reduce(c, dst=leader, group=self._intra, async_op=True) for c in chunks] if local else []
        across = []
        if self._leaders is not None and len(self.topology.groups) > 1:
            for index, chunk in enumerate(chunks):
                if local:
                    reduces[index].wait()
                across.append(self._cross(chunk, "leader"))
        if not local:
            for work in across:
                work.wait()
            return
        broadcasts = []
        for index, chunk in enumerate(chunks):
            (across[index] if across else reduces[index]).wait()  # a leader's across-phase began after its reduce
            broadcasts.append(dist.broadcast(chunk, src=leader, group=self._intra, async_op=True))
        for work in broadcasts:
            work.wait()

    def _reduce_scatter(self, flat: torch.Tensor) -> None:
        """Reduce-scatter in the group, allreduce each shard across groups, all-gather; pipelined."""
        assert self._shard is not None, "_validate refuses reduce_scatter on groups of unequal size"
        if self._segment is not None:
            self._through_host(flat, "reduce_scatter")
            return
        size = len(self.members)
        padded = -(-flat.numel() // size) * size
        work = flat if padded == flat.numel() else torch.zeros(padded, dtype=flat.dtype)
        if work is not flat:
            work[: flat.numel()].copy_(flat)
        chunks = self._chunks(work, multiple=size)
        shards = [torch.empty(c.numel() // size, dtype=c.dtype) for c in chunks]
        if size > 1:
            scatters = [dist.reduce_scatter_single(s, c, group=self._intra, async_op=True)
                        for s, c in zip(shards, chunks, strict=True)]
        else:
            shards = chunks
            scatters = []
        across = []
        for index, shard in enumerate(shards):
            if scatters:
                scatters[index].wait()
            if len(self.topology.groups) > 1:
                across.append(self._cross(shard, "reduce_scatter"))
        gathers = []
        for index, (shard, chunk) in enumerate(zip(shards, chunks, strict=True)):
            if across:
                across[index].wait()
            if size > 1:
                gathers.append(dist.all_gather_single(chunk, shard, group=self._intra, async_op=True))
        for handle in gathers:
            handle.wait()
        if work is not flat:
            flat.copy_(work[: flat.numel()])

    # --- checks and measurements ---

    def _validate(self, tensor: torch.Tensor, op: str, algorithm: str) -> None:
        if op not in OPS:
            raise ConfigError(f"unknown reduce op {op!r}; choose from {', '.join(OPS)}")
        check_algorithm(algorithm)
        if tensor.device.type != "cpu" and dist.get_backend() == "gloo":
            raise ConfigError(f"gloo reduces CPU tensors; this one is on {tensor.device}")
        if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ConfigError(f"op 'avg' needs a floating-point or complex tensor, not {tensor.dtype}; "
                              "use op 'sum' and divide")
        if algorithm == "reduce_scatter" and not self.topology.is_uniform:
            self.topology.shard_groups()  # raises the reason

    def _check_same(self, tensor: torch.Tensor, op: str, algorithm: str) -> None:
        dtype = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
        mine = torch.tensor([tensor.numel(), dtype, OPS.index(op), (*ALGORITHMS, "auto").index(algorithm)])
        every = torch.empty(self.world_size * 4, dtype=torch.int64)
        dist.all_gather_single(every, mine)
        rows = every.view(self.world_size, 4).tolist()
        if any(row != rows[0] for row in rows):
            differ = [rank for rank, row in enumerate(rows) if row != rows[0]]
            described = [f"rank {r}: {row[0]} elements of {_dtype_name(row[1])}, op {OPS[row[2]]}, "
                         f"algorithm {(*ALGORITHMS, 'auto')[row[3]]}" for r, row in enumerate(rows)
                         if r == 0 or r in differ][:4]
            raise ConfigError("allreduce called with different tensors or settings on different ranks ("
                              + "; ".join(described) + "); every rank must pass the same size, dtype, op and algorithm")

    def cost_model(self) -> CostModel:
        """The links' costs: given, cached for this job and topology, or measured now (collective)."""
        if self._cost is not None:
            return self._cost
        cached = load_cache(cache_file(self.cache_dir, self.topology), self.rank)
        if cached is not None:
            self._cost = cached[0]
            self._decided.update(cached[1])
            return self._cost
        self._cost = self.measure()
        self._save_cache()
        return self._cost

    def _save_cache(self) -> None:
        """Rank 0 writes what the job measured and settled (``autotune.save_cache``)."""
        path = cache_file(self.cache_dir, self.topology)
        if self.rank == 0 and path is not None and self._cost is not None and not self._cost_given:
            save_cache(path, self.topology, self._cost, self._decided)  # a given cost model is not the job's

    def measure(self) -> CostModel:
        """Measure the links and every usable algorithm now (collective; ``autotune.measure``)."""
        return measure(self)

    def _start_hook_thread(self) -> Queue[Callable[[], None] | None]:
        if self._hook_queue is None:
            queue: Queue[Callable[[], None] | None] = Queue()

            def serve() -> None:
                while (task := queue.get()) is not None:
                    task()

            threading.Thread(target=serve, name="convoy-allreduce-hook", daemon=True).start()
            self._hook_queue = queue
        return self._hook_queue


def _dtype_name(index: int) -> str:
    return str(_DTYPES[index]).removeprefix("torch.") if index < len(_DTYPES) else "another dtype"


_CACHED: dict[str, HierarchicalAllreduce] = {}


def allreduce(tensor: torch.Tensor, topology: Topology | None = None, algorithm: str = "auto",
              op: str = "sum") -> str:
    """Allreduce ``tensor`` in place with the topology's hierarchy (default: one group per node
    from the environment); returns the algorithm used. The sub-groups for a topology are built
    on its first call, so every rank must make that call."""
    topology = topology or Topology.from_env()
    comm = _CACHED.get(topology.key())
    if comm is None:
        comm = _CACHED[topology.key()] = HierarchicalAllreduce(topology)
    return comm.allreduce(tensor, op, algorithm)
