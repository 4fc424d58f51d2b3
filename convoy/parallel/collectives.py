"""Hierarchical allreduce over torch.distributed sub-groups, a DDP hook, and the automatic choice.

    comm = HierarchicalAllreduce(Topology.from_env())   # every rank, same order: builds sub-groups
    comm.allreduce(tensor, op="avg")                      # algorithm="auto": the cost model picks
    ddp.register_comm_hook(None, comm.ddp_hook())

Who sends what, and the cost model, live in ``topology.py``; this file makes the calls. Both
hierarchical algorithms cut the tensor into chunks and pipeline them, so the fast in-group
phases of one chunk overlap the slow cross-group phase of another. Where a group's ranks share
a machine, those in-group phases run through shared memory (``host_memory.py``), else on gloo.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from queue import Queue
from typing import Any

import torch
import torch.distributed as dist

from convoy.errors import ConfigError
from convoy.parallel.host_memory import HostSegment, chunk_sizes, host_allreduce, open_segment
from convoy.parallel.topology import (ALGORITHMS, CostModel, Link, Topology, check_algorithm, simplest_within,
                                      size_class)

OPS = ("sum", "avg")
CHUNK_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20
PROBE_BYTES = (1 << 20, 32 << 20)
PROBE_REPS = 7
SMALL_PROBE_REPS = 21
"""The small probe's reps: it is cheap, and a rep's spread is large next to its time."""
TRIAL_ROUNDS = 9
"""Calls each candidate gets in an ``auto`` trial (``HierarchicalAllreduce.choose``)."""
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
    tries each on the first real calls of that size and keeps the fastest (``choose``)."""

    def __init__(self, topology: Topology | None = None, *, cost: CostModel | None = None,
                 cache_dir: str | Path | None = None, chunk_bytes: int = CHUNK_BYTES, host_memory: bool = True,
                 tune: bool = True) -> None:
        if not dist.is_initialized():
            raise ConfigError("call convoy.init() (or init_process_group) before creating a HierarchicalAllreduce")
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1 (got {chunk_bytes})")
        self.topology = topology or Topology.from_env()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.topology.world_size != self.world_size:
            raise ConfigError(f"topology covers {self.topology.world_size} ranks but the process group has "
                              f"{self.world_size}; give one group entry per rank of the job")
        self.chunk_bytes, self.tune = chunk_bytes, tune
        self._cost, self._cost_given = cost, cost is not None
        self._decided: dict[int, str] = {}  # size class -> what auto runs, once a trial has settled it
        self._trials: dict[int, _Trial] = {}
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
        self._segment: HostSegment | None = None
        if host_memory:
            self._segment = open_segment(self._intra, self.members[0], self.members, self.rank,
                                         max(chunk_bytes, 16))
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
        first ``TRIAL_ROUNDS`` calls per candidate of ``auto`` at that size run the candidates in
        turn, each after a barrier; every rank times them, and the one that is least slower than
        the fastest of its round (median over rounds, slowest rank) stays (a more elaborate one
        only when it wins by ``CHOICE_MARGIN``).
        The trial is timed at the real size, in the real job, so it corrects what the start-up
        probes got wrong."""
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

    def _auto(self, nbytes: int) -> tuple[str, _Trial | None]:
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
            trial = self._trials[kind] = _Trial(candidates)
        return trial.next(), trial

    def _settle(self, nbytes: int, trial: _Trial) -> None:
        """End a trial (collective: every rank ends it on the same call). A call counts the slowest
        rank; a candidate scores the median over rounds of its time over the round's fastest
        (a round runs every candidate back to back, so a slow moment of the machine cancels)."""
        times = torch.tensor(trial.times, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        scores = (times / times.min(dim=0).values).median(dim=1).values.tolist()
        kind = size_class(nbytes)
        self._decided[kind] = simplest_within(dict(zip(trial.candidates, scores, strict=True)))
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
        across = self._leaders if crossing == "leader" else self._shard
        per_chunk = max(self.chunk_bytes // flat.element_size(), 1)
        host_allreduce(flat, self._segment, across if len(self.topology.groups) > 1 else None, crossing, per_chunk)

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
                across.append(dist.all_reduce(chunk, group=self._leaders, async_op=True))
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
                across.append(dist.all_reduce(shard, group=self._shard, async_op=True))
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
        cache = self._cache_file()
        found: list[Any] = [None]
        if self.rank == 0 and cache is not None and cache.exists():
            try:
                found[0] = json.loads(cache.read_text())
            except (OSError, ValueError):
                found[0] = None
        dist.broadcast_object_list(found, src=0)
        if found[0] is not None:
            saved = found[0]
            self._cost = CostModel(Link(*saved["intra"]), Link(*saved["inter"]),
                                   tuple((name, Link(*line)) for name, line in saved["measured"]))
            self._decided.update({int(kind): algorithm for kind, algorithm in saved.get("decided", {}).items()})
            return self._cost
        self._cost = self.measure()
        self._save_cache()
        return self._cost

    def _save_cache(self) -> None:
        """Rank 0 writes the links, the algorithms' lines and the settled trials for the job."""
        cache, cost = self._cache_file(), self._cost
        if self.rank != 0 or cache is None or cost is None or self._cost_given:
            return  # a cost model the caller gave is theirs, not this job's measurement
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({
            "topology": self.topology.key(), "intra": [cost.intra.latency_s, cost.intra.s_per_byte],
            "inter": [cost.inter.latency_s, cost.inter.s_per_byte],
            "measured": [[name, [line.latency_s, line.s_per_byte]] for name, line in cost.measured],
            "decided": {str(kind): algorithm for kind, algorithm in sorted(self._decided.items())}}))
        tmp.replace(cache)

    def _cache_file(self) -> Path | None:
        if self.cache_dir is None:
            return None
        digest = hashlib.sha1(self.topology.key().encode()).hexdigest()[:12]
        return self.cache_dir / f"links-{digest}.json"

    def measure(self) -> CostModel:
        """Time ring allreduces of two sizes inside the first group with more than one rank and
        among the leaders, fitting each link's latency and bandwidth; then each usable algorithm
        end to end at the same sizes (``_time_algorithms``). Every rank gets the same model."""
        groups = self.topology.groups
        local_group = next((i for i, g in enumerate(groups) if len(g) > 1), None)
        usable = [a for a in ALGORITHMS if a != "reduce_scatter" or self._shard is not None]
        mine = [0.0] * 4
        if local_group is not None and self.rank in groups[local_group]:
            mine[:2] = _fit(lambda b: dist.all_reduce(b, group=self._intra), self._intra, len(groups[local_group]))
        if len(groups) > 1 and self._leaders is not None:
            mine[2:4] = _fit(lambda b: dist.all_reduce(b, group=self._leaders), self._leaders, len(groups))
        every: list[list[float]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(every, mine)
        inter = Link(*every[self.topology.leaders[0]][2:4]) if len(groups) > 1 else None
        intra = Link(*every[groups[local_group][0]][:2]) if local_group is not None else None
        return CostModel(intra or inter or Link(0.0, 1e-9), inter or intra or Link(0.0, 1e-9),
                         self._time_algorithms(usable))

    def _time_algorithms(self, usable: list[str]) -> tuple[tuple[str, Link], ...]:
        """A line (fixed cost + cost per byte) per algorithm through its median time at each probe
        size. The algorithms take turns in an order drawn anew each rep (the same on every rank), so
        a slow moment of the machine, or the state one algorithm leaves behind, hits all of them
        alike; a rep counts the slowest rank, as the allreduce is done only when every rank is."""
        medians = []
        for nbytes in PROBE_BYTES:
            buffer = torch.ones(nbytes // 4, dtype=torch.float32)
            for algorithm in usable:
                self.allreduce(buffer, "sum", algorithm, check=False)  # warm the connections
            reps = SMALL_PROBE_REPS if nbytes == PROBE_BYTES[0] else PROBE_REPS
            times = torch.zeros(len(usable), reps, dtype=torch.float64)
            for rep in range(reps):
                for index in random.Random(rep).sample(range(len(usable)), len(usable)):
                    dist.barrier()
                    began = time.perf_counter()
                    self.allreduce(buffer, "sum", usable[index], check=False)
                    times[index, rep] = time.perf_counter() - began
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            medians.append(times.median(dim=1).values.tolist())
        small, large = PROBE_BYTES
        return tuple((algorithm, Link.fit_line((small, medians[0][index]), (large, medians[1][index])))
                     for index, algorithm in enumerate(usable))

    def _start_hook_thread(self) -> Queue[Callable[[], None] | None]:
        if self._hook_queue is None:
            queue: Queue[Callable[[], None] | None] = Queue()

            def serve() -> None:
                while (task := queue.get()) is not None:
                    task()

            threading.Thread(target=serve, name="convoy-allreduce-hook", daemon=True).start()
            self._hook_queue = queue
        return self._hook_queue


class _Trial:
    """One size class's trial: the candidates take turns, ``TRIAL_ROUNDS`` calls each, in an
    order rotated every round; ``times[i]`` holds candidate i's times on this rank."""

    def __init__(self, candidates: list[str]) -> None:
        self.candidates = candidates
        self.times: list[list[float]] = [[] for _ in candidates]
        self.calls = 0

    def next(self) -> str:
        turn, n = divmod(self.calls, len(self.candidates))
        return self.candidates[(n + turn) % len(self.candidates)]

    def record(self, algorithm: str, seconds: float) -> None:
        self.times[self.candidates.index(algorithm)].append(seconds)
        self.calls += 1

    @property
    def complete(self) -> bool:
        return self.calls == TRIAL_ROUNDS * len(self.candidates)


def _fit(run: Callable[[torch.Tensor], None], group: Any, ring_ranks: int) -> tuple[float, float]:
    """(fixed s, s/byte) of a link from the fastest of ``PROBE_REPS`` ring allreduces of ``ring_ranks``
    on ``group`` at two sizes (what the link can do: a busy moment of the machine only adds)."""
    points = []
    for nbytes in PROBE_BYTES:
        buffer = torch.ones(nbytes // 4, dtype=torch.float32)
        run(buffer)  # warm the connections
        times = []
        for _ in range(PROBE_REPS):
            dist.barrier(group=group)
            began = time.perf_counter()
            run(buffer)
            times.append(time.perf_counter() - began)
        points.append((float(nbytes), min(times)))
    link = Link.fit_ring(ring_ranks, points[0], points[1])
    return link.latency_s, link.s_per_byte


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
