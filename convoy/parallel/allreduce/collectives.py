"""Hierarchical allreduce over torch.distributed sub-groups, a DDP hook, and the automatic choice.

    comm = HierarchicalAllreduce(Topology.from_env())   # every rank, same order: builds sub-groups
    comm.allreduce(tensor, op="avg")                      # algorithm="auto": the cost model picks
    ddp.register_comm_hook(None, comm.ddp_hook())

Who sends what, and the cost model, live in ``topology.py``; what ``auto`` measures (probes,
trials, the job's cache) in ``autotune.py``; the checks of a call in ``agree.py``; this file makes
the calls. Both hierarchical algorithms cut the tensor into chunks and pipeline them, so the fast in-group
phases of one chunk overlap the slow cross-group phase of another. Where a group's ranks share
a machine, those in-group phases run through shared memory (``host_memory.py``), else on gloo;
the coded algorithms (``leader_coded``, ``reduce_scatter_coded``; ``auto`` tries them between two groups) send
the cross-group phase's chunks losslessly coded (``float_codec.py``).

Threads: the DDP hook reduces on a thread of its own, on a ``Lane`` (``lanes.py``) of private process
groups and its own shared-memory segment, so its calls never pair with the main thread's on another
rank (see ``HierarchicalAllreduce``).
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
from convoy.parallel.allreduce.agree import check_call, check_same_call
from convoy.parallel.allreduce.autotune import Trial, cache_file, load_cache, measure, save_cache, trial_rounds
from convoy.parallel.allreduce.float_codec import CodedSum, codable
from convoy.parallel.allreduce.host_memory import HOST_MEMORY, chunk_sizes, host_allreduce
from convoy.parallel.allreduce.lanes import Lane, open_lane, own_device
from convoy.parallel.topology import (ALGORITHMS, CODED, PLAIN, CostModel, Topology, check_algorithm, size_class,
                                     uncoded)

CHUNK_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


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

    ``compress``: with two groups, the cross-group phase can send float32, float64 and bfloat16 CPU chunks
    losslessly coded (``float_codec.py``: 7/8, 15/16 and 3/4 of the bytes) for some CPU time per byte:
    the algorithms ``leader_coded`` and ``reduce_scatter_coded``, the same sum to the bit. Worth it where
    the link between the groups is slow, not on fast links (``benchmarks/allreduce.py`` compares). None
    (the default): ``auto`` measures and tries them beside the plain ones, and keeps one only where it
    wins. True: every cross-group phase is coded (more than two groups are refused). False: ``auto``
    never codes (a call that names a coded algorithm still gets it).

    Threads: the calls of the thread that made the object (``allreduce``, ``allreduce_coalesced``,
    ``choose``, ``settled``, ``measure``) run on the default group and the object's sub-groups; the DDP
    hook's thread on private copies of all of them, with its own segment and trials (made by the first
    ``ddp_hook()`` call). So while DDP's buckets are reduced, the main thread may call ``allreduce`` here
    and any collective of its own, at any point. Two threads of yours calling ``allreduce`` at once
    would share one lane: give each thread its own object."""

    def __init__(self, topology: Topology | None = None, *, cost: CostModel | None = None,
                 cache_dir: str | Path | None = None, chunk_bytes: int = CHUNK_BYTES, host_memory: bool = True,
                 tune: bool = True, compress: bool | None = None) -> None:
        if not dist.is_initialized():
            raise ConfigError("call convoy.init() (or init_process_group) before creating a HierarchicalAllreduce")
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1 (got {chunk_bytes})")
        self.topology = topology or Topology.from_env()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.topology.world_size != self.world_size:
            raise ConfigError(f"topology covers {self.topology.world_size} ranks but the process group has "
                              f"{self.world_size}; give one group entry per rank of the job")
        if compress is True and len(self.topology.groups) > 2:
            raise ConfigError(f"compress=True codes what two groups exchange; this topology has "
                              f"{len(self.topology.groups)} groups (leave compress off)")
        self.chunk_bytes, self.tune = chunk_bytes, tune
        self._cost_given = cost is not None
        self._cache_lock = threading.RLock()  # the lanes' settled sizes, written by both threads, saved together
        self.device = own_device()
        run_dir = os.environ.get("CONVOY_RUN_DIR")
        self.cache_dir = Path(cache_dir) if cache_dir else (Path(run_dir) / "collectives" if run_dir else None)
        self.members = self.topology.groups[self.topology.group_of(self.rank)]
        self._code_all = compress is True and len(self.topology.groups) == 2
        self._may_code = compress is None and len(self.topology.groups) == 2 and self.device.type == "cpu"
        """Whether ``auto`` measures and tries the coded algorithms (they code CPU chunks only)."""
        self._cost = cost if cost is None or self._may_code else cost.plain_only()
        self._host_memory_wanted = host_memory
        self._settings = f"chunk={chunk_bytes} host_memory={host_memory} compress={compress}"  # the cache's key
        self._main = open_lane(self.topology, self.rank, False, host_memory, max(chunk_bytes, 16))
        self._hook_lane: Lane | None = None
        self._hook_queue: Queue[Callable[[], None] | None] | None = None

    # --- the public calls ---

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto", check: bool = True) -> str:
        """Reduce ``tensor`` in place across all ranks; returns the algorithm used.

        ``check`` first compares size, dtype, op and algorithm across ranks (one small all-gather)
        and raises ``ConfigError`` on every rank if they differ, before any data moves. CPU tensors
        need gloo and go through shared memory where the group has it; CUDA tensors need nccl."""
        return self._allreduce(self._main, tensor, op, algorithm, check)

    def _allreduce(self, lane: Lane, tensor: torch.Tensor, op: str, algorithm: str, check: bool) -> str:
        path = check_call(tensor, op, algorithm, self.topology)
        if check:
            check_same_call(lane.world, self.world_size, tensor, op, algorithm)
        nbytes = tensor.numel() * tensor.element_size()
        chosen, trial = self._auto(lane, nbytes) if algorithm == "auto" else (algorithm, None)
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        host = path == HOST_MEMORY and lane.segment is not None
        if trial is not None:
            dist.barrier(group=lane.world)  # a trial call times the algorithm, not the ranks' arrival skew
        began = time.perf_counter()
        phases, coded = uncoded(chosen), self._code_all or chosen in CODED
        if phases == "flat" or self.world_size == 1:
            dist.all_reduce(flat, group=lane.world)
        elif phases == "leader":
            self._leader(lane, flat, host, coded)
        else:
            self._reduce_scatter(lane, flat, host, coded)
        if trial is not None:
            trial.record(chosen, time.perf_counter() - began)
            if trial.complete:
                self._settle(lane, nbytes, trial)
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
        decided = self._main.decided.get(size_class(nbytes))
        return decided or self.cost_model().choose(self.topology, nbytes)

    def settled(self, nbytes: int) -> bool:
        """Whether ``auto`` has stopped trying algorithms at this size: no trial was needed, or it
        ended (measures the links the first time, as ``choose`` does: call it on every rank)."""
        if len(self.topology.groups) in (1, self.world_size) or not self.tune:
            return True
        kind = size_class(nbytes)
        if kind in self._main.decided or kind in self._main.trials:
            return kind in self._main.decided
        return len(self.cost_model().candidates(self.topology, nbytes)) == 1

    def ddp_hook(self, algorithm: str = "auto") -> Callable[[Any, dist.GradBucket], torch.futures.Future]:
        """A DDP communication hook averaging gradients with this allreduce:
        ``model.register_comm_hook(None, comm.ddp_hook())``. Buckets are reduced one at a time on
        a background thread, in the order DDP hands them over (the same on every rank), so the
        backward pass goes on computing while they travel. That thread has its own groups and
        segment (``Lane``): the first call makes them, a collective, so call it on every rank."""
        check_algorithm(algorithm)
        if algorithm == "auto":
            self.choose(1)  # measure now, on the main thread, not inside backward
        if self._hook_lane is None:
            self._hook_lane = open_lane(self.topology, self.rank, True, self._host_memory_wanted,
                                        max(self.chunk_bytes, 16))  # the same value on every rank
            with self._cache_lock:
                self._hook_lane.decided.update(self._main.decided)
        lane = self._hook_lane
        queue = self._start_hook_thread()

        def hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP rejects string annotations)
            future: torch.futures.Future = torch.futures.Future()
            buffer = bucket.buffer()

            def run() -> None:
                try:
                    self._allreduce(lane, buffer, "avg", algorithm, check=False)
                    future.set_result(buffer)
                except BaseException as exc:  # noqa: BLE001 (handed to DDP through the future)
                    future.set_exception(exc)

            queue.put(run)
            return future

        return hook

    def close(self) -> None:
        """Stop the DDP hook's thread (its groups, like the others, go with the default group)."""
        if self._hook_queue is not None:
            self._hook_queue.put(None)
            self._hook_queue = None

    def _auto(self, lane: Lane, nbytes: int) -> tuple[str, Trial | None]:
        """What this ``auto`` call on ``lane`` runs, and the trial it is part of (None once settled)."""
        if len(self.topology.groups) in (1, self.world_size):
            return "flat", None
        kind = size_class(nbytes)
        assert lane is self._main or self._cost is not None, "ddp_hook measures before the hook thread runs"
        cost = self.cost_model()  # first: it may load settled classes from the job's cache
        if kind in lane.decided:
            return lane.decided[kind], None
        if not self.tune:
            return cost.choose(self.topology, nbytes), None
        trial = lane.trials.get(kind)
        if trial is None:
            candidates = cost.candidates(self.topology, nbytes)
            if len(candidates) == 1:
                with self._cache_lock:
                    lane.decided[kind] = candidates[0]
                return candidates[0], None
            rounds = trial_rounds(sum(cost.predict(self.topology, c, nbytes) for c in candidates))
            trial = lane.trials[kind] = Trial(candidates, rounds)
        return trial.next(), trial

    def _settle(self, lane: Lane, nbytes: int, trial: Trial) -> None:
        """End a trial (collective over the lane: every rank ends it on the same call) and keep its winner."""
        kind = size_class(nbytes)
        winner = trial.settle(lane.world, self.device)
        with self._cache_lock:
            lane.decided[kind] = winner
            del lane.trials[kind]
            self._save_cache()

    # --- the algorithms ---

    def _chunks(self, flat: torch.Tensor, multiple: int = 1) -> list[torch.Tensor]:
        per_chunk = max(self.chunk_bytes // flat.element_size() // multiple, 1) * multiple
        return list(flat.split(per_chunk))

    @property
    def host_memory(self) -> bool:
        """Whether this rank's group runs its in-group phases of CPU tensors through shared memory."""
        return self._main.segment is not None

    def _through_host(self, lane: Lane, flat: torch.Tensor, crossing: str, coded: bool) -> None:
        assert lane.segment is not None
        cross = (lambda chunk: self._cross(lane, chunk, crossing, coded)) if len(self.topology.groups) > 1 else None
        host_allreduce(flat, lane.segment, cross, crossing, max(self.chunk_bytes // flat.element_size(), 1))

    def _cross(self, lane: Lane, chunk: torch.Tensor, crossing: str, coded: bool) -> Any:
        """Start summing ``chunk`` across the groups (over the leaders, or this rank's shard ring); a handle.
        ``coded``: two groups exchange it coded, where its dtype has a code (otherwise plain)."""
        group = lane.leaders if crossing == "leader" else lane.shard
        if coded and codable(chunk.dtype) and chunk.device.type == "cpu":
            return CodedSum(chunk, group, self.topology.partner(self.rank, crossing))
        return dist.all_reduce(chunk, group=group, async_op=True)

    def _leader(self, lane: Lane, flat: torch.Tensor, host: bool, coded: bool) -> None:
        """Reduce to the leader, allreduce among leaders, broadcast; chunk by chunk, pipelined."""
        if host:
            self._through_host(lane, flat, "leader", coded)
            return
        leader, local = self.members[0], len(self.members) > 1
        # cut as host_allreduce cuts: a lone rank's group runs this while the others' groups use host memory
        chunks = list(flat.split(chunk_sizes(flat.numel(), max(self.chunk_bytes // flat.element_size(), 1))))
        reduces = [dist.reduce(c, dst=leader, group=lane.intra, async_op=True) for c in chunks] if local else []
        across = []
        if lane.leaders is not None and len(self.topology.groups) > 1:
            for index, chunk in enumerate(chunks):
                if local:
                    reduces[index].wait()
                across.append(self._cross(lane, chunk, "leader", coded))
        if not local:
            for work in across:
                work.wait()
            return
        broadcasts = []
        for index, chunk in enumerate(chunks):
            (across[index] if across else reduces[index]).wait()  # a leader's across-phase began after its reduce
            broadcasts.append(dist.broadcast(chunk, src=leader, group=lane.intra, async_op=True))
        for work in broadcasts:
            work.wait()

    def _reduce_scatter(self, lane: Lane, flat: torch.Tensor, host: bool, coded: bool) -> None:
        """Reduce-scatter in the group, allreduce each shard across groups, all-gather; pipelined."""
        assert lane.shard is not None, "check_call refuses reduce_scatter on groups of unequal size"
        if host:
            self._through_host(lane, flat, "reduce_scatter", coded)
            return
        size = len(self.members)
        padded = -(-flat.numel() // size) * size
        work = flat if padded == flat.numel() else torch.zeros(padded, dtype=flat.dtype, device=flat.device)
        if work is not flat:
            work[: flat.numel()].copy_(flat)
        chunks = self._chunks(work, multiple=size)
        shards = [torch.empty(c.numel() // size, dtype=c.dtype, device=c.device) for c in chunks]
        if size > 1:
            scatters = [dist.reduce_scatter_single(s, c, group=lane.intra, async_op=True)
                        for s, c in zip(shards, chunks, strict=True)]
        else:
            shards = chunks
            scatters = []
        across = []
        for index, shard in enumerate(shards):
            if scatters:
                scatters[index].wait()
            if len(self.topology.groups) > 1:
                across.append(self._cross(lane, shard, "reduce_scatter", coded))
        gathers = []
        for index, (shard, chunk) in enumerate(zip(shards, chunks, strict=True)):
            if across:
                across[index].wait()
            if size > 1:
                gathers.append(dist.all_gather_single(chunk, shard, group=lane.intra, async_op=True))
        for handle in gathers:
            handle.wait()
        if work is not flat:
            flat.copy_(work[: flat.numel()])

    # --- checks and measurements ---

    def cost_model(self) -> CostModel:
        """The links' costs: given, cached for this job and topology, or measured now (collective)."""
        if self._cost is not None:
            return self._cost
        cached = load_cache(self.cache_path, self.rank)
        if cached is not None:
            self._cost = cached[0]
            with self._cache_lock:
                self._main.decided.update(cached[1])
            return self._cost
        self._cost = self.measure()
        self._save_cache()
        return self._cost

    @property
    def cache_path(self) -> Path | None:
        """The job's cache of what this topology and these settings measured (None: no cache)."""
        return cache_file(self.cache_dir, self.topology, self._settings)

    def _save_cache(self) -> None:
        """Rank 0 writes what the job measured and settled on either lane (``autotune.save_cache``)."""
        path = self.cache_path
        if self.rank == 0 and path is not None and self._cost is not None and not self._cost_given:
            with self._cache_lock:
                decided = {**(self._hook_lane.decided if self._hook_lane else {}), **self._main.decided}
                save_cache(path, self.topology, self._cost, decided)  # a given cost model is not the job's

    def measure(self) -> CostModel:
        """Measure the links and every usable algorithm now (collective; ``autotune.measure``)."""
        usable = [a for a in ALGORITHMS if (uncoded(a) != "reduce_scatter" or self._main.shard is not None)
                  and (a in PLAIN or self._may_code)]
        return measure(self.topology, self.rank, self._main.intra, self._main.leaders,
                       lambda buffer, algorithm: self.allreduce(buffer, "sum", algorithm, check=False), usable,
                       self.device)

    def _start_hook_thread(self) -> Queue[Callable[[], None] | None]:
        if self._hook_queue is None:
            queue: Queue[Callable[[], None] | None] = Queue()

            def serve() -> None:
                while (task := queue.get()) is not None:
                    task()

            threading.Thread(target=serve, name="convoy-allreduce-hook", daemon=True).start()
            self._hook_queue = queue
        return self._hook_queue

