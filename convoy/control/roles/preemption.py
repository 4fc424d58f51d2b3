"""A job of roles in the machine's pool: what it claims, what it gives back to jobs of higher priority, and how
its preempted roles grow back. Called on the master's tick, under its lock, after ``RoleMaster`` placed what it
could; the scheduler (``control/pool/scheduler.py``) holds the pool's claims.

A preempted process is told first (its agent writes its notice: ``convoy.role().preempted``), finishes its unit of
work and exits; SIGTERM follows after the job's preempt grace, SIGKILL after the stop grace. Its exit is counted
as released, not failed: the role runs one fewer until the pool has room again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convoy.control.job import Event
from convoy.control.pool.claims import Amount, total

if TYPE_CHECKING:
    from convoy.control.roles.master import RoleMaster


def claim(master: RoleMaster) -> tuple[Amount, Amount, Amount]:
    """(held, floor, wants): what this job's processes hold (one stopping still holds it until it exits), the part
    that stays (each role at its MIN), and what its processes waiting for the pool (and its preempted
    roles, one process each) ask for."""
    held = floor = Amount()
    for name, spec in master.specs.items():
        keys = [key for key in master.placed if key[0] == name]
        for key in keys:
            held = held + master.need(name, key[1]).amount()
        current = [key for key in keys if key not in master.stopping and master.is_running(*key)]
        kept = sorted(current, key=lambda key: key[1])[:spec.count.minimum]
        floor = total([floor, *(master.need(name, key[1]).amount() for key in kept)])
    master.pool_waiting = {key for key in master.pool_waiting
                           if any((start.role, start.rank, start.incarnation) == key for start in master.pending)}
    wants = total(master.need(role, rank).amount() for role, rank, _ in master.pool_waiting)
    for name, state in master.roles.roles.items():
        if state.grow_to > state.target:
            wants = wants + master.need(name, state.target).amount()
    return held, floor, wants


def pool_tick(master: RoleMaster) -> list[Event]:
    """Sync the claim; give back what jobs of higher priority need, else grow a preempted role by one where the
    pool has room for it; then place what waits."""
    if not master.begun:
        return []
    if master.scheduler.shared:  # (its claim is O(processes): not made for a job without a pool, at every tick)
        master.scheduler.sync(*claim(master))
    releasing = total(master.need(role, rank).amount() for role, rank, _ in master.releasing)  # freed as they exit
    owed = (master.scheduler.give_back() - releasing).clipped()
    if owed.any():
        return _preempt(master, owed) + master.advance()
    events: list[Event] = []
    room = master.scheduler.room()
    for name, state in master.roles.roles.items():
        need = master.need(name, state.target).amount()
        if state.grow_to > state.target and need.within(room):
            decisions, more = master.roles.grow_back(name)
            events += more + master.carry_out(decisions)
            room = (room - need).clipped()
    return events + master.advance()


def _preempt(master: RoleMaster, owed: Amount) -> list[Event]:
    """Give back processes of elastic roles until ``owed`` is covered: roles whose processes stand alone before role
    groups (a group's other members must form again), and among those the one furthest above its MIN first; only
    roles whose processes hold some of what is owed free any, and none goes below its MIN."""
    events: list[Event] = []
    asked = owed
    while owed.any():
        candidates = [(not state.spec.group, state.target - state.spec.count.minimum, name)
                      for name, state in master.roles.roles.items()
                      if state.target > state.spec.count.minimum
                      and master.need(name, max(state.members, default=0)).amount().helps(owed)]
        if not candidates:
            break
        *_, name = max(candidates)
        freed = master.need(name, max(master.roles.roles[name].members)).amount()
        decisions, more = master.roles.preempt(name, f"a job of higher priority asks for {asked.describe()} more than "
                                                     f"the pool has free; told to finish its unit of work, SIGTERM "
                                                     f"after {master.preempt_grace_s:g} s")
        events += more + master.carry_out(decisions)
        owed = (owed - freed).clipped()
    return events
