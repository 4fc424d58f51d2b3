"""Pipeline schedules as data: the action format, the generators, and the comms they need.

A schedule is ``dict[rank, list[Action]]``: for each rank, the ordered list of what it does
in one training step. ``validate.py`` checks one, ``simulate.py`` times one, ``runtime.py``
executes one and ``timeline.py`` draws one; none of them knows which generator made it.

Stages are numbered in forward order, ``0 .. n_stages - 1``; ``placement[s]`` is the rank
that holds stage ``s``. Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from convoy.errors import ScheduleError


class Kind(str, Enum):
    """What an action does. Compute: F, B (full backward), I (input grad), W (weight grad), H."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the name the zero-bubble papers use
    W = "W"
    H = "H"
    """Helper half of a forward that a bubble-filling rank computes for ``peer`` (the owner)."""
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.H})
COMMS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})


@dataclass(frozen=True)
class Action:
    """``kind`` for micro-batch ``mb`` of ``stage``.

    ``SEND_F s`` sends stage s's output to stage s+1; ``RECV_F s`` receives stage s's input
    from stage s-1; ``SEND_B s`` sends the gradient of stage s's input to stage s-1;
    ``RECV_B s`` receives the gradient of stage s's output from stage s+1. A forward with a
    ``peer`` is split with that rank (tensor parallel), which runs the matching ``H``."""

    kind: Kind
    stage: int
    mb: int
    peer: int | None = None

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.mb}"
        return text if self.peer is None else f"{text}@{self.peer}"

    @property
    def compute(self) -> bool:
        return self.kind in COMPUTE


@dataclass(frozen=True)
class Schedule:
    """One training step of a pipeline: ``actions[rank]`` in order, stages placed on ranks."""

    name: str
    n_microbatches: int
    placement: tuple[int, ...]
    actions: dict[int, list[Action]] = field(compare=False)

    @property
    def n_stages(self) -> int:
        return len(self.placement)

    @property
    def n_ranks(self) -> int:
        return len(self.actions)

    def stages_of(self, rank: int) -> list[int]:
        return [stage for stage, owner in enumerate(self.placement) if owner == rank]

    def grid(self, comms: bool = False) -> str:
        """The schedule as text, one row per rank, one column per action (compute only by default)."""
        rows = {rank: [str(a) for a in acts if comms or a.compute] for rank, acts in sorted(self.actions.items())}
        width = max((len(cell) for row in rows.values() for cell in row), default=1)
        lines = [f"{self.name}: {self.n_stages} stages on {self.n_ranks} ranks, {self.n_microbatches} micro-batches"]
        lines += [f"rank {rank}: " + " ".join(cell.ljust(width) for cell in row) for rank, row in rows.items()]
        return "\n".join(lines)


def check_shape(n_ranks: int, n_microbatches: int, n_layers: int | None = None, chunks: int = 1) -> None:
    """Raise ``ScheduleError`` unless the pipeline can be built: at least one rank and one
    micro-batch, and (when ``n_layers`` is given) a layer for every stage."""
    if n_ranks < 1:
        raise ScheduleError(f"a pipeline needs at least 1 rank, got {n_ranks}")
    if n_microbatches < 1:
        raise ScheduleError(f"a pipeline needs at least 1 micro-batch, got {n_microbatches}")
    if chunks < 1:
        raise ScheduleError(f"each rank needs at least 1 stage, got {chunks} per rank")
    stages = n_ranks * chunks
    if n_layers is not None and n_layers < stages:
        raise ScheduleError(f"{stages} stages but the model has only {n_layers} layers; "
                            f"use at most {n_layers} stages (fewer ranks or chunks per rank)")


def split_microbatches(batch: int, n_microbatches: int) -> int:
    """Micro-batch size; ``ScheduleError`` unless ``n_microbatches`` divides ``batch``."""
    if n_microbatches < 1 or batch % n_microbatches:
        raise ScheduleError(f"{n_microbatches} micro-batches do not divide the batch of {batch}; "
                            f"pick a micro-batch count that divides it")
    return batch // n_microbatches


def with_comms(name: str, n_microbatches: int, placement: tuple[int, ...],
               compute: dict[int, list[Action]]) -> Schedule:
    """Insert the sends and receives that ``compute`` needs: a receive right before the action
    that consumes it, a send right after the action that produces it (sends are async)."""
    last = len(placement) - 1
    actions: dict[int, list[Action]] = {}
    for rank, acts in compute.items():
        out: list[Action] = []
        for act in acts:
            s, mb = act.stage, act.mb
            if act.kind is Kind.F and s > 0 and placement[s - 1] != rank:
                out.append(Action(Kind.RECV_F, s, mb))
            if act.kind in (Kind.B, Kind.I) and s < last and placement[s + 1] != rank:
                out.append(Action(Kind.RECV_B, s, mb))
            out.append(act)
            if act.kind is Kind.F and s < last and placement[s + 1] != rank:
                out.append(Action(Kind.SEND_F, s, mb))
            if act.kind in (Kind.B, Kind.I) and s > 0 and placement[s - 1] != rank:
                out.append(Action(Kind.SEND_B, s, mb))
        actions[rank] = out
    return Schedule(name, n_microbatches, placement, actions)


def gpipe(n_ranks: int, n_microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe)."""
    check_shape(n_ranks, n_microbatches)
    compute = {r: [Action(Kind.F, r, i) for i in range(n_microbatches)]
               + [Action(Kind.B, r, i) for i in range(n_microbatches)] for r in range(n_ranks)}
    return with_comms("gpipe", n_microbatches, tuple(range(n_ranks)), compute)


def one_f_one_b(n_ranks: int, n_microbatches: int) -> Schedule:
    """1F1B: rank r runs ``p - 1 - r`` warm-up forwards, then alternates forward and backward."""
    check_shape(n_ranks, n_microbatches)
    compute: dict[int, list[Action]] = {}
    for r in range(n_ranks):
        warm = min(n_microbatches, n_ranks - 1 - r)
        acts = [Action(Kind.F, r, i) for i in range(warm)]
        for i in range(n_microbatches - warm):
            acts += [Action(Kind.F, r, warm + i), Action(Kind.B, r, i)]
        acts += [Action(Kind.B, r, i) for i in range(n_microbatches - warm, n_microbatches)]
        compute[r] = acts
    return with_comms("1f1b", n_microbatches, tuple(range(n_ranks)), compute)


def interleaved(n_ranks: int, n_microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): ``chunks`` stages per rank, stage ``c * p + r`` on rank r.

    Micro-batches go through in groups of ``p``, so ``p`` must divide the micro-batch count."""
    check_shape(n_ranks, n_microbatches, chunks=chunks)
    p, m, v = n_ranks, n_microbatches, chunks
    if m % p:
        raise ScheduleError(f"interleaved 1F1B runs micro-batches in groups of {p} (the rank count); "
                            f"{m} micro-batches is not a multiple of {p}")
    total = m * v

    def virtual(k: int, backward: bool) -> Action:
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        if backward:
            return Action(Kind.B, (v - 1 - chunk) * p + rank, mb)
        return Action(Kind.F, chunk * p + rank, mb)

    compute: dict[int, list[Action]] = {}
    for rank in range(p):
        warm = min(total, (p - rank - 1) * 2 + (v - 1) * p)
        acts = [virtual(k, False) for k in range(warm)]
        for k in range(total - warm):
            acts += [virtual(warm + k, False), virtual(k, True)]
        acts += [virtual(k, True) for k in range(total - warm, total)]
        compute[rank] = acts
    return with_comms(f"interleaved{v}", m, tuple(s % p for s in range(v * p)), compute)


def two_group_offsets(n_ranks: int, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0
                      ) -> dict[tuple[int, int], int]:
    """Steady-state lag, in cycles, of each (phase, rank) of the two-group schedule.

    Phases 0..3 are F1, B1, F2, B2 in a rank's cycle order; in cycle ``t`` rank r runs phase
    k on micro-batch ``t - lag[k, r]``. Rank r starts its cycles ``r * (forward + comm)``
    late, so a forward can pass down the ranks within one cycle; a hop back up the ranks
    waits at least one cycle (the skew is not reliable against its grain, e.g. while the
    pipeline fills, and a tighter lag stalls every cycle). Each hop of a micro-batch
    (F1 down the ranks, to F2 on rank 0, F2 down, B2 up, to B1 on the last rank, B1 up)
    waits the fewest whole cycles after which, in that steady state, its producer has
    finished and the message arrived. Lags only grow along a micro-batch's path and a
    same-cycle hop only goes to a later rank or a later phase, so no wait can be circular."""
    p, f, b = n_ranks, forward, backward
    cycle = 2 * f + 2 * b
    begin = {0: 0.0, 1: f, 2: f + b, 3: 2 * f + b}
    cost = {0: f, 1: b, 2: f, 3: b}

    def start(phase: int, rank: int) -> float:
        return rank * (f + comm) + begin[phase]

    path = ([(0, r) for r in range(p)] + [(2, r) for r in range(p)]
            + [(3, r) for r in reversed(range(p))] + [(1, r) for r in reversed(range(p))])
    lag = {path[0]: 0}
    for prev, node in zip(path[:-1], path[1:], strict=True):
        ready = start(*prev) + cost[prev[0]] + (comm if prev[1] != node[1] else 0.0)
        wait = max(0, math.ceil((ready - start(*node)) / cycle - 1e-9))
        if node[1] < prev[1]:
            wait = max(wait, 1)  # against the skew: the steady state only holds a cycle later
        lag[node] = lag[prev] + wait
    return lag


def two_group(n_ranks: int, n_microbatches: int, forward: float = 1.0, backward: float = 2.0,
              comm: float = 0.0) -> Schedule:
    """The two-group schedule: 2p slices, the first p form sub-model 1 and the last p sub-model
    2; rank r holds slice r of each (stages r and p + r). Each cycle a rank runs the forward of
    sub-model 1, the backward of sub-model 1 for an earlier micro-batch, the forward of
    sub-model 2 and the backward of sub-model 2, at the lags of :func:`two_group_offsets`
    (computed for the given relative costs; the schedule is valid for any)."""
    check_shape(n_ranks, n_microbatches)
    p, m = n_ranks, n_microbatches
    lag = two_group_offsets(p, forward, backward, comm)
    kinds = {0: (Kind.F, 0), 1: (Kind.B, 0), 2: (Kind.F, p), 3: (Kind.B, p)}
    cycles = m + max(lag.values())
    compute: dict[int, list[Action]] = {}
    for r in range(p):
        acts: list[Action] = []
        for t in range(cycles):
            for phase in range(4):
                mb = t - lag[phase, r]
                if 0 <= mb < m:
                    kind, base = kinds[phase]
                    acts.append(Action(kind, base + r, mb))
        compute[r] = acts
    return with_comms("two-group", m, tuple(s % p for s in range(2 * p)), compute)


GENERATORS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "two-group": two_group}


def build(name: str, n_ranks: int, n_microbatches: int) -> Schedule:
    """The schedule called ``name`` (one of ``GENERATORS``) with default options."""
    if name not in GENERATORS:
        raise ScheduleError(f"unknown schedule {name!r}; choose from {', '.join(GENERATORS)}")
    return GENERATORS[name](n_ranks, n_microbatches)


def stages_per_rank(schedule: Schedule) -> int:
    """How many stages each rank holds (1 for GPipe/1F1B, 2 for interleaved-2 and two-group)."""
    return schedule.n_stages // max(1, schedule.n_ranks)


def split_backward(schedule: Schedule) -> Schedule:
    """Split every B into I (input gradient, sent upstream at once) and W (weight gradient),
    each W deferred to just before the rank's next forward, or to the end: the zero-bubble
    idea of filling waits with weight gradients."""
    actions: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        out: list[Action] = []
        deferred: list[Action] = []
        for act in acts:
            if act.kind is Kind.B:
                out.append(Action(Kind.I, act.stage, act.mb))
                deferred.append(Action(Kind.W, act.stage, act.mb))
                continue
            if act.kind in (Kind.F, Kind.RECV_F) and deferred:
                out += deferred
                deferred = []
            out.append(act)
        actions[rank] = out + deferred
    return Schedule(f"{schedule.name}-iw", schedule.n_microbatches, schedule.placement, actions)
