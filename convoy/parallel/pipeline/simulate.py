"""Time a schedule on paper: makespan, bubble fraction and activations in flight per rank.

Costs are for the whole model and one micro-batch; a stage costs its share (``1 / n_stages``
of the model by default, or the given ``stage_weights``), so schedules that cut the same
model into more stages compare fairly. A send costs its sender nothing and arrives
``comm`` later; a receive waits for its arrival. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from convoy.errors import ScheduleError
from convoy.parallel.pipeline.schedule import Action, Kind, Schedule
from convoy.parallel.pipeline.validate import validate, walk


@dataclass(frozen=True)
class Costs:
    """Seconds (or any unit) for one micro-batch through the whole model."""

    forward: float = 1.0
    """Forward pass of the whole model."""
    backward: float = 2.0
    """Full backward (B) of the whole model."""
    input_grad: float | None = None
    """I (gradient of the input only); default half of ``backward``."""
    weight_grad: float | None = None
    """W (gradient of the weights only); default half of ``backward``."""
    comm: float = 0.0
    """One activation or gradient message between ranks, from send to arrival."""
    fill_share: float = 0.5
    """Part of a split forward that the helper computes."""
    fill_comm: float | None = None
    """Sending a split forward's input to the helper, or its partial output back; default ``comm``."""
    fill_params: float = 0.0
    """Sending a stage's parameter shard to a helper, once per (stage, helper) and step."""
    fill_overhead: float = 0.0
    """Extra time the owner spends to split and merge a forward."""
    fill_rounds: int = 1
    """Exchanges per split forward (one per MLP block of the stage): each sends the block's
    input to the helper and waits for its part back before the next block can start."""
    stage_weights: tuple[float, ...] | None = None
    """Relative cost of each stage; default equal."""

    def share(self, schedule: Schedule, stage: int) -> float:
        weights = self.stage_weights
        if weights is None:
            return 1.0 / schedule.n_stages
        if len(weights) != schedule.n_stages or min(weights) < 0 or sum(weights) <= 0:
            raise ScheduleError(f"stage_weights needs {schedule.n_stages} non-negative weights, got {weights}")
        return weights[stage] / sum(weights)

    def of(self, schedule: Schedule, act: Action) -> float:
        half = self.backward / 2
        whole = {Kind.F: self.forward, Kind.H: self.forward, Kind.B: self.backward,
                 Kind.I: half if self.input_grad is None else self.input_grad,
                 Kind.W: half if self.weight_grad is None else self.weight_grad}[act.kind]
        return whole * self.share(schedule, act.stage)


@dataclass(frozen=True)
class Span:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Result:
    """What one simulated (or measured) step looks like."""

    makespan: float
    busy: dict[int, float]
    peak_activations: dict[int, float]
    """Most micro-batch activations a rank holds at once, in units of one micro-batch through the whole model."""
    spans: list[Span] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Idle fraction over all ranks: 1 - busy time / (ranks x makespan)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan)

    def rank_bubble(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.makespan if self.makespan > 0 else 0.0

    def summary(self) -> str:
        peak = max(self.peak_activations.values(), default=0.0)
        return f"makespan {self.makespan:.3f}  bubble {self.bubble:.1%}  peak activations {peak:.2f} micro-batches"


def activations(schedule: Schedule, rank: int) -> float:
    """Peak activations rank ``rank`` holds in one step, following its own action order."""
    held = peak = 0.0
    for act in schedule.actions[rank]:
        if act.kind is Kind.F:
            held += 1.0 / schedule.n_stages
            peak = max(peak, held)
        elif act.kind in (Kind.B, Kind.W):
            held -= 1.0 / schedule.n_stages
    return peak


def simulate(schedule: Schedule, costs: Costs | None = None, check: bool = True) -> Result:
    """Run ``schedule`` on paper with ``costs``; ``ScheduleError`` if it is not valid."""
    costs = costs or Costs()
    if check:
        validate(schedule)
    fill_comm = costs.comm if costs.fill_comm is None else costs.fill_comm
    free = dict.fromkeys(schedule.actions, 0.0)
    busy = dict.fromkeys(schedule.actions, 0.0)
    arrival: dict[tuple[Kind, int, int], float] = {}
    spans: list[Span] = []
    shipped: set[tuple[int, int]] = set()
    split: dict[tuple[int, int], float] = {}
    """(stage, mb) -> when the owner starts its split forward."""

    def visit(rank: int, act: Action) -> None:
        now = free[rank]
        if act.kind in (Kind.SEND_F, Kind.SEND_B):
            arrival[act.kind, act.stage, act.mb] = now + costs.comm
            return
        if act.kind in (Kind.RECV_F, Kind.RECV_B):
            kind, step = (Kind.SEND_F, -1) if act.kind is Kind.RECV_F else (Kind.SEND_B, 1)
            free[rank] = max(now, arrival[kind, act.stage + step, act.mb])
            return
        cost = costs.of(schedule, act)
        if act.kind is Kind.F and act.peer is not None:
            split[act.stage, act.mb] = now  # timed with its helper's H, visited next
            return
        if act.kind is Kind.H:
            owner, begun = act.peer, split[act.stage, act.mb]
            rounds = max(1, costs.fill_rounds)
            own = (cost * (1 - costs.fill_share) + costs.fill_overhead) / rounds
            theirs = cost * costs.fill_share / rounds
            ready = now
            if (act.stage, rank) not in shipped:
                shipped.add((act.stage, rank))
                ready = max(ready, begun + costs.fill_params)
            at, first = begun, None
            for _ in range(rounds):  # input out, both compute, the helper's part back
                start = max(ready, at + fill_comm)
                first = start if first is None else first
                ready = start + theirs
                at = max(at + own, ready + fill_comm)
            owned = next(a for a in schedule.actions[owner] if a.kind is Kind.F and (a.stage, a.mb) == (act.stage,
                                                                                                      act.mb))
            spans.append(Span(owner, owned, begun, at))
            spans.append(Span(rank, act, first, ready))
            busy[owner] += own * rounds
            busy[rank] += theirs * rounds
            free[owner], free[rank] = at, ready
            return
        spans.append(Span(rank, act, now, now + cost))
        busy[rank] += cost
        free[rank] = now + cost

    walk(schedule, visit)
    makespan = max(free.values(), default=0.0)
    peaks = {rank: activations(schedule, rank) for rank in schedule.actions}
    return Result(makespan, busy, peaks, spans)


def compare(schedules: list[Schedule], costs: Costs | None = None) -> str:
    """A table of makespan, bubble and peak activations for each schedule under ``costs``."""
    lines = [f"{'schedule':<14} {'stages':>6} {'makespan':>9} {'bubble':>7} {'peak act (max rank)':>20}"]
    for schedule in schedules:
        result = simulate(schedule, costs)
        lines.append(f"{schedule.name:<14} {schedule.n_stages:>6} {result.makespan:>9.3f} {result.bubble:>7.1%} "
                     f"{max(result.peak_activations.values()):>20.2f}")
    return "\n".join(lines)
