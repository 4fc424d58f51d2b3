"""Candidate strategies for a model on some ranks, each kept or dropped with the reason (pure).

Only combinations that make sense together: FSDP's own reduce-scatter has no allreduce choice; the
hierarchical allreduces only where nodes hold several ranks; checkpointing only where it lets a larger
micro-batch fit than without it; bfloat16 only where the calibration step did not find it slower, or
where nothing fits without it; intra-op threads only up to the cores a rank has; bucket sizes only
for plain DDP at its largest micro-batch; local SGD (averaging every ``LOCAL_SGD_EVERY`` steps) only
where there are several nodes, whose links are the slow ones; pipelines (``pipelines``) where the model
gives its layers in order, without checkpointing (a stage keeps a share of the activations already); sequences cut
over a node's ranks (``sequences``) where the model attends through ``convoy.attention`` over long enough
sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from convoy.errors import ConfigError
from convoy.strategy.memory import ModelFeatures, MemoryEstimate, predict, smallest_need
from convoy.strategy.plan import Strategy

BUCKETS_MB = (5, 100)
"""DDP bucket sizes tried beside the default 25 MB."""
MICRO_BATCHES_KEPT = 2
"""The largest feasible micro-batches kept per combination (a smaller one can run faster from cache)."""
SLOWER_BF16 = 1.5
"""bfloat16 measured this many times slower than float32 in the calibration step: not a candidate."""
HEADROOM = 0.95
"""A candidate fits when its predicted peak is at most this share of the limit: the memory model is within
about 10% of what runs measure (most within 5%), and a run over the limit is what the search must not cause."""
LOCAL_SGD_EVERY = 8
"""Steps between local SGD's averagings (the held-out loss stayed within 1% of DDP's at 8 in
``benchmarks/local_sgd.py``)."""


@dataclass(frozen=True)
class Hardware:
    """The ranks a plan is for and where they run."""

    nodes: int
    nproc_per_node: int
    memory_limit: float
    """Bytes a rank may use for training (above its process baseline)."""
    cores: int
    """CPU cores of the machine the ranks of one node share."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def cores_per_rank(self) -> float:
        return self.cores / self.nproc_per_node

    def validate(self) -> Hardware:
        if self.nodes < 1 or self.nproc_per_node < 1:
            raise ConfigError(f"need --nodes and --nproc-per-node >= 1 (got {self.nodes} and {self.nproc_per_node})")
        if self.memory_limit <= 0:
            raise ConfigError(f"the memory limit must be > 0 bytes (got {self.memory_limit})")
        return self


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    memory: MemoryEstimate
    dropped: str = ""
    """Why it is not measured ("" if it is a candidate)."""


def micro_batches(batch: int) -> list[int]:
    """The batch, and its halvings while they divide it, largest first."""
    found, size = [batch], batch
    while size % 2 == 0 and size > 1:
        size //= 2
        found.append(size)
    return found


def pipelines(features: ModelFeatures, world: int) -> list[tuple[int, str]]:
    """(stages, schedule) of the pipelines a model's layers allow on ``world`` ranks: every degree >= 2 that
    divides the world, with 1F1B, and interleaved 1F1B where there are layers for two stages a rank (GPipe
    has 1F1B's bubble and holds more micro-batches at once: never a candidate)."""
    layers = len(features.layers)
    return [(stages, schedule) for stages in range(2, world + 1) if world % stages == 0 and stages <= layers
            for schedule in ("1f1b", "interleaved") if schedule == "1f1b" or 2 * stages <= layers]


SEQUENCE_MIN_PART = 128
"""The fewest positions a rank's part of a sample may have under the sequence strategy (shorter parts make
attention's messages cost more than the work they spread)."""


def sequences(features: ModelFeatures, hardware: Hardware) -> list[int]:
    """Ranks a sample's positions may be cut over: every degree >= 2 that divides a node's ranks (query broadcast's
    messages stay on the node) and the sequence length, leaving parts of ``SEQUENCE_MIN_PART`` or more."""
    length = features.sequence.length
    return [ranks for ranks in range(2, hardware.nproc_per_node + 1)
            if hardware.nproc_per_node % ranks == 0 and length % ranks == 0 and length // ranks >= SEQUENCE_MIN_PART]


def _combinations(features: ModelFeatures, hardware: Hardware) -> list[tuple[str, str, bool, int, dict]]:
    """(kind, allreduce, bf16, threads, the kind's own fields) of every combination to size."""
    world = hardware.world_size
    kinds = ["ddp"] + (["zero"] if world > 1 else []) + (["fsdp"] if world > 1 and features.has_blocks else [])
    kinds += ["local"] * (hardware.nodes > 1)
    hierarchical = hardware.nodes > 1 and hardware.nproc_per_node > 1
    threads = sorted({1, *(t for t in (2, 4, 8) if t <= hardware.cores_per_rank)})
    shapes: dict[str, list[dict]] = {
        "pipeline": [{"stages": stages, "schedule": schedule} for stages, schedule in pipelines(features, world)],
        "sequence": [{"sequence": ranks} for ranks in sequences(features, hardware)]}
    combos = []
    for kind in kinds + [kind for kind, found in shapes.items() if found]:
        for allreduce in ["gloo"] + (["leader", "reduce_scatter"] if hierarchical and kind in ("ddp", "zero") else []):
            for bf16 in (False, True):
                for thread_count in threads:
                    for shape in shapes.get(kind, [{}]):
                        combos.append((kind, allreduce, bf16, thread_count, shape))
    return combos


INTERLEAVED_GAIN = 0.97
"""Interleaved 1F1B is a candidate only where predicted at most this share of its 1F1B twin's time (it holds
more activations and sends twice the messages, for a bubble that ranks sharing cores may fill anyway)."""


def generate(features: ModelFeatures, hardware: Hardware,
             step_time: Callable[[Strategy], float] | None = None) -> list[Candidate]:
    """Every candidate considered, in a stable order; ``dropped`` says why one is not measured.

    ``step_time``: the cost model, for choices one candidate's predicted time decides (interleaved 1F1B)."""
    hardware.validate()
    world, limit = hardware.world_size, hardware.memory_limit * HEADROOM
    rows: list[Candidate] = []
    for kind, allreduce, bf16, threads, shape in _combinations(features, hardware):
        fitting: list[Candidate] = []
        largest_plain = 0
        recomputes = features.has_blocks and kind not in ("pipeline", "sequence")
        for checkpointing in (False, True) if recomputes else (False,):
            for micro in micro_batches(features.batch):
                strategy = Strategy(kind, allreduce, checkpointing, bf16, micro, features.batch // micro,
                                    threads=threads, sync_every=LOCAL_SGD_EVERY if kind == "local" else 1, **shape)
                memory = predict(features, strategy, world, hardware.nproc_per_node)
                if memory.peak > limit:
                    rows.append(Candidate(strategy, memory, over_the_limit(memory.peak, limit)))
                elif checkpointing and micro <= largest_plain:
                    rows.append(Candidate(strategy, memory, f"checkpointing without a larger micro-batch than "
                                                            f"{largest_plain} without it"))
                else:
                    if not checkpointing:
                        largest_plain = max(largest_plain, micro)
                    fitting.append(Candidate(strategy, memory))
        fitting.sort(key=lambda c: -c.strategy.micro_batch)
        for index, candidate in enumerate(fitting):
            if index >= MICRO_BATCHES_KEPT:
                rows.append(replace(candidate, dropped=f"a smaller micro-batch than the {MICRO_BATCHES_KEPT} "
                                                        "largest that fit"))
            else:
                rows.append(candidate)
    rows = _drop_slow_bf16(rows, features)
    if step_time is not None:
        rows = _drop_slow_interleaved(rows, step_time)
    return _add_buckets(rows, features, world, limit)


def _drop_slow_interleaved(rows: list[Candidate], step_time: Callable[[Strategy], float]) -> list[Candidate]:
    kept_ones = {c.strategy for c in rows if not c.dropped}
    out = []
    for candidate in rows:
        s = candidate.strategy
        twin = replace(s, schedule="1f1b")
        if not candidate.dropped and s.schedule == "interleaved" and twin in kept_ones:
            mine, theirs = step_time(s), step_time(twin)
            if mine > INTERLEAVED_GAIN * theirs:
                candidate = replace(candidate, dropped=f"interleaved not predicted {1 - INTERLEAVED_GAIN:.0%} faster "
                                                       f"than 1f1b: {mine:.3f} s against {theirs:.3f} s")
        out.append(candidate)
    return out


def _drop_slow_bf16(rows: list[Candidate], features: ModelFeatures) -> list[Candidate]:
    if features.bf16_time_factor <= SLOWER_BF16 or all(c.dropped for c in rows if not c.strategy.bf16):
        return rows
    reason = f"bf16 ran {features.bf16_time_factor:.1f}x slower than float32 in the calibration step"
    return [replace(c, dropped=reason) if c.strategy.bf16 and not c.dropped else c for c in rows]


def _add_buckets(rows: list[Candidate], features: ModelFeatures, world: int, limit: float) -> list[Candidate]:
    extra = []
    for candidate in rows:
        s = candidate.strategy
        if (not candidate.dropped and s.kind == "ddp" and s.allreduce == "gloo" and not s.checkpointing
                and not s.bf16 and s.accumulation == 1 and world > 1):
            for bucket in BUCKETS_MB:
                other = replace(s, bucket_mb=bucket)
                memory = predict(features, other, world)
                extra.append(Candidate(other, memory, "" if memory.peak <= limit else
                                       over_the_limit(memory.peak, limit)))
    return rows + extra


def over_the_limit(peak: float, usable: float) -> str:
    return f"over the limit: needs {peak / 1e6:.0f} MB of the {usable / 1e6:.0f} MB usable ({HEADROOM:.0%} of it)"


def kept(rows: list[Candidate]) -> list[Candidate]:
    return [c for c in rows if not c.dropped]


def require_feasible(rows: list[Candidate], features: ModelFeatures, hardware: Hardware) -> list[Candidate]:
    """The candidates to measure, or a ``ConfigError`` naming the smallest need when none fits."""
    found = kept(rows)
    if not found:
        best, need = smallest_need(features, [c.strategy for c in rows], hardware.world_size)
        raise ConfigError(f"no candidate fits {megabytes(hardware.memory_limit)} per rank: the smallest need is "
                          f"{megabytes(need)} ({best.name()}), and {HEADROOM:.0%} of the limit is usable; raise "
                          f"--memory to at least {megabytes(need / HEADROOM)}, or use more ranks")
    return found


def megabytes(nbytes: float) -> str:
    return f"{nbytes / 1e6:.0f} MB" if nbytes >= 10e6 else f"{nbytes / 1e6:.2f} MB"


def plain_ddp(features: ModelFeatures) -> Strategy:
    """The peer every pick is compared with: DDP over gloo, the whole batch at once, float32."""
    return Strategy("ddp", "gloo", False, False, features.batch, 1)
