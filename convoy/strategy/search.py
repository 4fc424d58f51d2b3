"""Rank candidates by a cost model, then measure the best few by successive halving (pure).

The cost model: compute from the calibration step's time per sample and per micro-step (scaled for
checkpointing, bfloat16 and the cores a rank gets), the optimizer step on the rank's share, and the
gradient traffic from the allreduce lines the collectives measured (``CommCosts``). The measured
search gives the top ``keep`` a few steps each, keeps the faster half, doubles the steps, and so on (stopping
early where one is far ahead).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from convoy.parallel.topology import Link
from convoy.strategy.candidates import Hardware
from convoy.strategy.memory import ModelFeatures, pipeline_stages, stage_sum
from convoy.strategy.plan import Strategy

THREAD_EFFICIENCY = 0.8
"""Each intra-op thread past the first adds this much of one thread's speed (where a core is free)."""
KEEP = 8
"""Candidates the measured search starts with, best predicted first (the cost model ranks within about 2x on a
shared CPU; the top 4 missed the grid's best in 3 of 4 benchmark cases)."""
FIRST_STEPS = 1
"""Timed steps each in the first round (after one warm-up step); each survivor's total doubled every round."""
DECISIVE = 0.15
"""From the second round on, a fastest this much ahead of the next (a share of its step time) wins without the
rounds left: a gap wider than most of what separates one measurement from the next on a shared 2-core machine."""

FSDP_ALLREDUCES = 4.0
"""FSDP's collectives in one micro-step (two all-gathers, one reduce-scatter), in allreduces of the parameters, where
they were not timed (gloo on 4 ranks, 54 and 82 MB: an all-gather 0.8-1.3 allreduces, a reduce-scatter 1.4-1.9);
fresh buffers' page faults come on top, so the search times them (``CommCosts.fsdp_pass_s``)."""

T = TypeVar("T")


@dataclass(frozen=True)
class CommCosts:
    """Measured allreduce time lines (fixed + per byte) over all ranks, by algorithm (``gloo`` = DDP's;
    ``node``: over one node's ranks only, where nodes hold several), and FSDP's collectives in one micro-step on
    this model's units, timed (``fsdp_pass_s``; None where not measured)."""

    lines: Mapping[str, Link] = field(default_factory=dict)
    fsdp_pass_s: float | None = None

    def allreduce(self, algorithm: str, nbytes: float, messages: int = 1) -> float:
        line = self.lines.get(algorithm) or self.lines["gloo"]
        return messages * line.latency_s + nbytes * line.s_per_byte

    def to_dict(self) -> dict:
        return {"lines": {name: [link.latency_s, link.s_per_byte] for name, link in self.lines.items()},
                "fsdp_pass_s": self.fsdp_pass_s}

    @classmethod
    def from_dict(cls, data: Mapping) -> CommCosts:
        lines = {name: Link(float(a), float(b)) for name, (a, b) in data["lines"].items()}
        return cls(lines, None if data.get("fsdp_pass_s") is None else float(data["fsdp_pass_s"]))


def rank_speed(threads: int, cores_per_rank: float) -> float:
    """How many one-thread speeds a rank computes at, with ``threads`` on its share of the cores."""
    usable = min(float(threads), max(cores_per_rank, 0.0))
    if usable <= 1:
        return max(usable, 1e-3)
    return 1 + THREAD_EFFICIENCY * (usable - 1)


def _pipeline_time(features: ModelFeatures, strategy: Strategy, hardware: Hardware, comm: CommCosts) -> float:
    """The schedule simulated with each stage's share of a micro-batch's compute (a forward a third, the
    backward two) and a message's time from the measured line; a rank computes alone when the others wait (its
    bubble lends them its cores), but no faster than its share of the cores allows for its own work. Then the
    optimizer on its stages and, with several pipelines, the allreduce of their gradients."""
    from convoy.parallel.pipeline.simulate import Costs, simulate

    schedule, bounds = pipeline_stages(features, strategy)
    weights = [stage_sum(features, b, "weight") for b in bounds]
    per_micro = features.micro_step_s + features.sample_s * strategy.micro_batch
    if strategy.bf16:
        per_micro *= features.bf16_time_factor
    boundary = sum(stage_sum(features, (b[1] - 1, b[1]), "out_per_sample") for b in bounds[:-1]) / max(
        1, len(bounds) - 1) * strategy.micro_batch
    line = comm.lines["gloo"]
    message = line.latency_s + boundary * line.s_per_byte / 2  # a ring allreduce moves each byte twice
    costs = Costs(forward=per_micro / 3, backward=2 * per_micro / 3, comm=message, stage_weights=tuple(weights))
    makespan = simulate(schedule, costs, check=False).makespan
    busiest = max(sum(weights[s] for s in schedule.stages_of(r)) for r in range(schedule.n_ranks)) / sum(weights)
    own_work = per_micro * schedule.n_microbatches * busiest
    compute = max(makespan / rank_speed(strategy.threads, hardware.cores),
                  own_work / rank_speed(strategy.threads, hardware.cores_per_rank))
    params = max(sum(stage_sum(features, bounds[s], "param_bytes") for s in schedule.stages_of(r))
                 for r in range(schedule.n_ranks))
    optimizer = features.optimizer_s * params / features.param_bytes / rank_speed(strategy.threads,
                                                                                  hardware.cores_per_rank)
    traffic = 2 * line.latency_s  # the group's batch gathered, the loss broadcast
    if hardware.world_size > strategy.stages:
        traffic += comm.allreduce("gloo", params)
    return compute + optimizer + traffic


def _sequence_messages(features: ModelFeatures, strategy: Strategy, comm: CommCosts) -> float:
    """Query broadcast's messages in one step, for the rank that sends the most: in each attention call of each
    micro-batch, its queries to the ``sequence - 1`` others and their partial outputs back, then in the backward
    its output gradient out and the query gradients back; and the group's batch gathered, its loss averaged."""
    ranks, line = strategy.sequence, comm.lines["gloo"]
    part = strategy.micro_batch * features.sequence.query_bytes_per_sample / ranks  # float32 under bf16 too
    per_call = 4 * line.latency_s + 4 * (ranks - 1) * part * line.s_per_byte / 2  # an allreduce moves bytes twice
    return ranks * strategy.accumulation * features.sequence.calls * per_call + 3 * line.latency_s


def predict_time(features: ModelFeatures, strategy: Strategy, hardware: Hardware, comm: CommCosts) -> float:
    """Seconds of one optimizer step on one rank."""
    if strategy.kind == "pipeline":
        return _pipeline_time(features, strategy, hardware, comm)
    speed = rank_speed(strategy.threads, hardware.cores_per_rank)
    compute = features.micro_step_s * strategy.accumulation + features.sample_s * strategy.batch
    if strategy.kind == "sequence":  # as many positions a rank as DDP's, in sequence x more micro-batches; causal
        # attention gives the last part's rank (2n - 1) / n of DDP's attention work, the others less
        ranks, share = strategy.sequence, features.sequence.attention_share
        imbalance = (2 * ranks - 1) / ranks if features.sequence.causal else 1.0
        compute = (features.micro_step_s * strategy.accumulation * ranks
                   + features.sample_s * strategy.batch * (1 - share + share * imbalance))
    if strategy.bf16:
        compute *= features.bf16_time_factor
    if strategy.checkpointing:
        compute *= features.checkpoint_time_factor
    world = hardware.world_size
    share = 1.0 / world if strategy.kind in ("zero", "fsdp") else 1.0
    optimizer = features.optimizer_s * share
    params = float(features.param_bytes)
    if world == 1:
        return (compute + optimizer) / speed
    if strategy.kind == "local":  # DDP within the node each step; all ranks average every sync_every steps
        buckets = max(1, math.ceil(params / (strategy.bucket_mb * 2 ** 20)))
        within = comm.allreduce("node", params, buckets) if hardware.nproc_per_node > 1 else 0.0
        traffic = within + comm.allreduce("gloo", params) / strategy.sync_every
    elif strategy.kind == "fsdp":  # each micro-step gathers the parameters twice and reduce-scatters the gradients
        units = len(features.block_param_bytes) + 1
        per_micro = comm.fsdp_pass_s
        if per_micro is None:  # gloo's all-gather costs about an allreduce, its reduce-scatter about two
            per_micro = FSDP_ALLREDUCES * comm.allreduce("gloo", params, 3 * units)
        traffic = strategy.accumulation * per_micro
    else:
        buckets = max(1, math.ceil(params / (strategy.bucket_mb * 2 ** 20)))
        traffic = comm.allreduce(strategy.allreduce, params, buckets)
        if strategy.kind == "sequence":
            traffic += _sequence_messages(features, strategy, comm)
        if strategy.kind == "zero":  # each rank's updated shard broadcast: an all-gather, half an allreduce
            traffic += 0.5 * comm.allreduce("gloo", params, world)
    return (compute + optimizer) / speed + traffic


@dataclass
class Measured:
    candidate: object
    steps: int
    seconds: float


def successive_halving(ranked: Sequence[T], measure: Callable[[T, int], list[float]], keep: int = KEEP,
                       first_steps: int = FIRST_STEPS, eta: int = 2, decisive: float = DECISIVE
                       ) -> tuple[T, list[list[Measured]]]:
    """Measure the first ``keep`` of ``ranked`` (best predicted first) for ``first_steps`` steps each, keep the
    fastest ``1/eta``, and measure each of those again until it has ``eta`` times the steps, until one is left:
    ``(winner, rounds)``. A candidate's figure is the median of all its steps so far (``measure`` returns each new
    step's seconds), so a round adds only the steps its survivors lack. After the first round, a fastest ahead of
    the next by ``decisive`` (a share of its time) or more wins at once."""
    if not ranked:
        raise ValueError("successive halving needs at least one candidate")
    alive, steps, rounds = list(ranked[:keep]), first_steps, []
    times: dict[T, list[float]] = {candidate: [] for candidate in alive}
    while True:
        results = []
        for candidate in alive:
            times[candidate] += measure(candidate, steps - len(times[candidate]))
            results.append(Measured(candidate, len(times[candidate]), statistics.median(times[candidate])))
        rounds.append(results)
        results.sort(key=lambda m: m.seconds)
        if len(results) <= 1 or (len(rounds) > 1 and results[1].seconds >= results[0].seconds * (1 + decisive)):
            break
        alive = [m.candidate for m in results[:max(1, math.ceil(len(results) / eta))]]
        if len(alive) == 1:
            break
        steps *= eta
    return results[0].candidate, rounds  # type: ignore[return-value]
