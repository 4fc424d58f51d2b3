"""Is a schedule runnable? Every check names the first offending action. Pure: no torch.

``validate`` checks, in this order: stages and micro-batches in range and placed on the
rank that runs them; every (stage, micro-batch) has one forward and one backward (B, or I
then W) and the backward comes after the forward; every receive has its send and each
sits on the right side of the compute it feeds; and, by stepping all ranks together with
async sends and blocking receives, that no rank waits forever (deadlock).
"""

from __future__ import annotations

from collections.abc import Callable

from convoy.errors import ScheduleError
from convoy.parallel.pipeline.schedule import Action, Kind, Schedule

Visit = Callable[[int, Action], None]
"""Called once per action, in an order that respects every cross-rank dependency."""


def _where(rank: int, index: int, act: Action) -> str:
    return f"rank {rank}, action {index} ({act})"


def _check_ranges(schedule: Schedule) -> None:
    if sorted(schedule.actions) != list(range(schedule.n_ranks)):
        raise ScheduleError(f"schedule ranks must be 0..{schedule.n_ranks - 1}, got {sorted(schedule.actions)}")
    if schedule.n_microbatches < 1 or not schedule.placement:
        raise ScheduleError("a schedule needs at least one stage and one micro-batch")
    for stage, owner in enumerate(schedule.placement):
        if not 0 <= owner < schedule.n_ranks:
            raise ScheduleError(f"stage {stage} is placed on rank {owner}, which the schedule does not have")
    for rank, acts in schedule.actions.items():
        for index, act in enumerate(acts):
            if not 0 <= act.stage < schedule.n_stages:
                raise ScheduleError(f"{_where(rank, index, act)}: there is no stage {act.stage}")
            if not 0 <= act.mb < schedule.n_microbatches:
                raise ScheduleError(f"{_where(rank, index, act)}: there is no micro-batch {act.mb}")
            home = schedule.placement[act.stage]
            if act.kind is Kind.H:
                if act.peer != home or act.peer == rank:
                    raise ScheduleError(f"{_where(rank, index, act)}: a helper action must name the owner "
                                        f"of stage {act.stage} (rank {home}) as its peer")
            elif home != rank:
                raise ScheduleError(f"{_where(rank, index, act)}: stage {act.stage} is placed on rank {home}")
            elif act.peer is not None and (act.kind is not Kind.F or act.peer == rank
                                           or not 0 <= act.peer < schedule.n_ranks):
                raise ScheduleError(f"{_where(rank, index, act)}: only a forward can name a helper, "
                                    f"and it must be another rank")


def _check_compute(schedule: Schedule) -> None:
    seen: dict[tuple[Kind, int, int], tuple[int, int]] = {}
    for rank, acts in schedule.actions.items():
        for index, act in enumerate(acts):
            if not act.compute:
                continue
            key = (act.kind, act.stage, act.mb)
            if key in seen:
                raise ScheduleError(f"{_where(rank, index, act)}: runs a second time "
                                    f"(first at rank {seen[key][0]}, action {seen[key][1]})")
            seen[key] = (rank, index)
            need = {Kind.B: Kind.F, Kind.I: Kind.F, Kind.W: Kind.I}.get(act.kind)
            if need is not None and (need, act.stage, act.mb) not in seen:
                raise ScheduleError(f"{_where(rank, index, act)}: comes before the {need.value} "
                                    f"of stage {act.stage} micro-batch {act.mb} on this rank")
            if act.kind is Kind.H:
                continue
            _check_local_order(schedule, rank, index, act, seen)
            pair = {Kind.B: (Kind.I, Kind.W), Kind.I: (Kind.B,), Kind.W: (Kind.B,)}.get(act.kind, ())
            if any((other, act.stage, act.mb) in seen for other in pair):
                raise ScheduleError(f"{_where(rank, index, act)}: stage {act.stage} micro-batch {act.mb} "
                                    f"already has a backward; use B, or I then W, not both")
    for stage in range(schedule.n_stages):
        for mb in range(schedule.n_microbatches):
            if (Kind.F, stage, mb) not in seen:
                raise ScheduleError(f"stage {stage} micro-batch {mb} has no forward (F) on rank "
                                    f"{schedule.placement[stage]}")
            if (Kind.B, stage, mb) not in seen and (Kind.W, stage, mb) not in seen:
                raise ScheduleError(f"stage {stage} micro-batch {mb} has no backward (B, or I then W) on rank "
                                    f"{schedule.placement[stage]}")
    for (kind, stage, mb), (rank, index) in seen.items():
        if kind is Kind.F:
            act = schedule.actions[rank][index]
            if act.peer is not None and (Kind.H, stage, mb) not in seen:
                raise ScheduleError(f"{_where(rank, index, act)}: helper rank {act.peer} has no H for it")
        if kind is Kind.H:
            owner, at = seen[Kind.F, stage, mb]
            if schedule.actions[owner][at].peer != rank:
                act = schedule.actions[rank][index]
                raise ScheduleError(f"{_where(rank, index, act)}: the forward it helps does not name rank {rank}")


def _check_local_order(schedule: Schedule, rank: int, index: int, act: Action,
                       seen: dict[tuple[Kind, int, int], tuple[int, int]]) -> None:
    """Neighbouring stages on one rank pass tensors without messages: the order must be right."""
    place, stage, mb = schedule.placement, act.stage, act.mb
    if act.kind is Kind.F and stage > 0 and place[stage - 1] == rank and (Kind.F, stage - 1, mb) not in seen:
        raise ScheduleError(f"{_where(rank, index, act)}: comes before the forward of stage {stage - 1} "
                            f"micro-batch {mb}, whose output it takes")
    if act.kind in (Kind.B, Kind.I) and stage < len(place) - 1 and place[stage + 1] == rank and \
            (Kind.B, stage + 1, mb) not in seen and (Kind.I, stage + 1, mb) not in seen:
        raise ScheduleError(f"{_where(rank, index, act)}: comes before the backward of stage {stage + 1} "
                            f"micro-batch {mb}, whose input gradient it takes")


def _needed_comms(schedule: Schedule) -> dict[tuple[Kind, int, int], int]:
    """Every send and receive the compute needs, and the rank that must run it."""
    place, last, need = schedule.placement, schedule.n_stages - 1, {}
    for stage in range(schedule.n_stages):
        for mb in range(schedule.n_microbatches):
            if stage < last and place[stage + 1] != place[stage]:
                need[Kind.SEND_F, stage, mb] = place[stage]
                need[Kind.RECV_B, stage, mb] = place[stage]
            if stage > 0 and place[stage - 1] != place[stage]:
                need[Kind.RECV_F, stage, mb] = place[stage]
                need[Kind.SEND_B, stage, mb] = place[stage]
    return need


def _check_comms(schedule: Schedule) -> None:
    need = _needed_comms(schedule)
    have: set[tuple[Kind, int, int]] = set()
    for rank, acts in schedule.actions.items():
        done: set[tuple[Kind, int, int]] = set()
        for index, act in enumerate(acts):
            key = (act.kind, act.stage, act.mb)
            if act.compute:
                if act.kind is Kind.F and (Kind.RECV_F, act.stage, act.mb) in need and \
                        (Kind.RECV_F, act.stage, act.mb) not in done:
                    raise ScheduleError(f"{_where(rank, index, act)}: its input is not received before it "
                                        f"(add {act.stage}RECV_F{act.mb} first)")
                if act.kind in (Kind.B, Kind.I) and (Kind.RECV_B, act.stage, act.mb) in need and \
                        (Kind.RECV_B, act.stage, act.mb) not in done:
                    raise ScheduleError(f"{_where(rank, index, act)}: its output gradient is not received before "
                                        f"it (add {act.stage}RECV_B{act.mb} first)")
                done.add(key)
                continue
            if key not in need:
                raise ScheduleError(f"{_where(rank, index, act)}: no such message: stage {act.stage}'s neighbour "
                                    f"in that direction is on the same rank or does not exist")
            if key in have:
                raise ScheduleError(f"{_where(rank, index, act)}: this message is already sent or received")
            producer = {Kind.SEND_F: Kind.F, Kind.SEND_B: Kind.B}.get(act.kind)
            if producer is not None and (producer, act.stage, act.mb) not in done and \
                    (Kind.I, act.stage, act.mb) not in done:
                raise ScheduleError(f"{_where(rank, index, act)}: sends before the {producer.value} that "
                                    f"produces it")
            have.add(key)
            done.add(key)
    for key, rank in need.items():
        if key not in have:
            kind, stage, mb = key
            raise ScheduleError(f"rank {rank} never runs {stage}{kind.value}{mb}, which the pipeline needs")


def walk(schedule: Schedule, visit: Visit) -> None:
    """Step all ranks together: sends never block, a receive waits for its send, a split
    forward and its helper action run together. ``ScheduleError`` names the waits on deadlock."""
    pos = dict.fromkeys(schedule.actions, 0)
    sent: set[tuple[Kind, int, int]] = set()
    source = {Kind.RECV_F: (Kind.SEND_F, -1), Kind.RECV_B: (Kind.SEND_B, 1)}
    while True:
        progress = False
        for rank, acts in schedule.actions.items():
            while pos[rank] < len(acts):
                act = acts[pos[rank]]
                if act.kind in source:
                    kind, step = source[act.kind]
                    if (kind, act.stage + step, act.mb) not in sent:
                        break
                elif act.kind is Kind.H:
                    break  # runs when its owner reaches the forward
                elif act.kind is Kind.F and act.peer is not None:
                    helper = schedule.actions[act.peer]
                    at = pos[act.peer]
                    if at >= len(helper) or (helper[at].kind, helper[at].stage, helper[at].mb) != \
                            (Kind.H, act.stage, act.mb):
                        break
                    visit(rank, act)
                    visit(act.peer, helper[at])
                    pos[act.peer] += 1
                    pos[rank] += 1
                    progress = True
                    continue
                if act.kind in (Kind.SEND_F, Kind.SEND_B):
                    sent.add((act.kind, act.stage, act.mb))
                visit(rank, act)
                pos[rank] += 1
                progress = True
        if all(pos[r] == len(a) for r, a in schedule.actions.items()):
            return
        if not progress:
            stuck = [_where(r, pos[r], a[pos[r]]) for r, a in schedule.actions.items() if pos[r] < len(a)]
            raise ScheduleError("deadlock: every unfinished rank waits; " + "; ".join(stuck))


def validate(schedule: Schedule) -> Schedule:
    """Return ``schedule`` if it is runnable; else raise ``ScheduleError`` naming the first offence."""
    _check_ranges(schedule)
    _check_compute(schedule)
    _check_comms(schedule)
    walk(schedule, lambda rank, act: None)
    return schedule
