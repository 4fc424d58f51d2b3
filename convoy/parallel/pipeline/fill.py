"""Plan bubble filling: which forwards to split with an idle rank, decided by the simulator.

A forward of stage s on micro-batch mb can be split with tensor parallelism: the helper
rank computes part of each MLP block (columns of the first linear, the matching rows of the
second) while the owner computes the rest. It pays only while the helper would otherwise be
idle and when the compute saved beats sending the input, the partial results, and once per
step the parameter shard. ``plan_fills`` tries each forward, in simulated start order, with
each rank idle for its whole span, and keeps a split only if the simulated step gets
shorter. Pure: no torch; ``parallel/tensor/blocks.py`` executes the splits.
"""

from __future__ import annotations

from collections.abc import Iterable

from convoy.errors import ScheduleError
from convoy.parallel.pipeline.schedule import Action, Kind, Schedule
from convoy.parallel.pipeline.simulate import Costs, Result, Span, simulate
from convoy.parallel.pipeline.validate import validate

GAIN = 1e-9
"""Smallest simulated saving that counts as one."""


def _idle(spans: list[Span], rank: int, start: float, end: float) -> bool:
    return not any(s.rank == rank and s.start < end and s.end > start for s in spans)


def _insert_help(schedule: Schedule, result: Result, helper: int, act: Action, at: float) -> list[Action]:
    """The helper's actions with ``H`` placed where its simulated time ``at`` falls: before
    the next compute (and the receives right before it), after the sends of the last one."""
    acts = list(schedule.actions[helper])
    starts = {(s.action.kind, s.action.stage, s.action.mb): s.start for s in result.spans if s.rank == helper}
    index = len(acts)
    for i, other in enumerate(acts):
        if other.compute and starts.get((other.kind, other.stage, other.mb), float("inf")) >= at:
            index = i
            break
    while index > 0 and acts[index - 1].kind in (Kind.RECV_F, Kind.RECV_B):
        index -= 1
    acts.insert(index, Action(Kind.H, act.stage, act.mb, peer=schedule.placement[act.stage]))
    return acts


def with_fill(schedule: Schedule, act: Action, helper: int, result: Result) -> Schedule:
    """``schedule`` with forward ``act`` split with ``helper``."""
    owner = schedule.placement[act.stage]
    owned = [Action(a.kind, a.stage, a.mb, helper) if a == act else a for a in schedule.actions[owner]]
    start = next(s.start for s in result.spans if s.action == act)
    actions = {**schedule.actions, owner: owned, helper: _insert_help(schedule, result, helper, act, start)}
    return Schedule(schedule.name, schedule.n_microbatches, schedule.placement, actions)


def plan_fills(schedule: Schedule, costs: Costs, fillable: Iterable[int] | None = None,
               max_fills: int | None = None) -> tuple[Schedule, Result]:
    """Split every forward of a ``fillable`` stage (default all) with an idle rank where the
    simulator says the step gets shorter; returns the filled schedule (named ``NAME+fill``)
    and its simulated result. Each accepted split is validated."""
    allowed = set(range(schedule.n_stages) if fillable is None else fillable)
    best = simulate(schedule, costs)
    current, fills = schedule, 0
    order = sorted((s for s in best.spans if s.action.kind is Kind.F and s.action.stage in allowed),
                   key=lambda s: (s.start, s.rank))
    for span in order:
        if max_fills is not None and fills >= max_fills:
            break
        act = span.action
        live = next((s for s in best.spans if s.action == act), None)
        if live is None:
            continue
        choice: tuple[Schedule, Result] | None = None
        for helper in range(schedule.n_ranks):
            if helper == live.rank or not _idle(best.spans, helper, live.start, live.end):
                continue
            trial = with_fill(current, act, helper, best)
            try:
                outcome = simulate(trial, costs)
            except ScheduleError:  # a placement that would deadlock is just not a candidate
                continue
            if outcome.makespan < (choice[1].makespan if choice else best.makespan) - GAIN:
                choice = (trial, outcome)
        if choice is not None:
            current, best = choice
            fills += 1
    name = f"{schedule.name}+fill" if fills else schedule.name
    filled = Schedule(name, current.n_microbatches, current.placement, current.actions)
    return validate(filled), best
