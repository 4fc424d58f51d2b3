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
from convoy.control.pool.claims import EPSILON

if TYPE_CHECKING:
    from convoy.control.roles.master import RoleMaster


def claim(master: RoleMaster) -> tuple[float, float, float]:
    """(held, floor, wants): the CPUs this job's processes hold (one stopping still holds them until it exits), the
    part that stays (each role at its MIN; a group whole), and what its processes waiting for the pool (and its
    preempted roles, one process each) ask for."""
    held = floor = 0.0
    for name, spec in master.specs.items():
        cpus = spec.cpus or 0.0
        keys = [key for key in master.placed if key[0] == name]
        current = sum(1 for key in keys if key not in master.stopping and master.is_running(*key))
        held += cpus * len(keys)
        floor += cpus * (current if spec.group else min(current, spec.count.minimum))
    master.pool_waiting = {key for key in master.pool_waiting
                           if any((start.role, start.rank, start.incarnation) == key for start in master.pending)}
    wants = sum(master.specs[role].cpus or 0.0 for role, _, _ in master.pool_waiting)
    wants += sum(state.spec.cpus or 0.0 for state in master.roles.roles.values() if state.grow_to > state.target)
    return held, floor, wants


def pool_tick(master: RoleMaster) -> list[Event]:
    """Sync the claim; give back what jobs of higher priority need, else grow a preempted role by one where the
    pool has room for it; then place what waits."""
    if not master.begun:
        return []
    master.scheduler.sync(*claim(master))
    releasing = sum(master.specs[key[0]].cpus or 0.0 for key in master.releasing)  # freed as they exit
    owed = master.scheduler.give_back() - releasing
    if owed > EPSILON:
        return _preempt(master, owed) + master.advance()
    events: list[Event] = []
    room = master.scheduler.room()
    for name, state in master.roles.roles.items():
        cpus = state.spec.cpus or 0.0
        if state.grow_to > state.target and cpus <= room + EPSILON:
            decisions, more = master.roles.grow_back(name)
            events += more + master.carry_out(decisions)
            room -= cpus
    return events + master.advance()


def _preempt(master: RoleMaster, owed: float) -> list[Event]:
    """Give back processes of elastic roles (the one furthest above its MIN first; only roles that declare cpus
    free any) until ``owed`` CPUs are covered; none below a role's MIN."""
    events: list[Event] = []
    asked = owed
    while owed > EPSILON:
        candidates = [(state.target - state.spec.count.minimum, name) for name, state in master.roles.roles.items()
                      if (state.spec.cpus or 0.0) > 0 and state.target > state.spec.count.minimum
                      and not state.spec.group]
        if not candidates:
            break
        _, name = max(candidates)
        cpus = master.specs[name].cpus or 0.0
        decisions, more = master.roles.preempt(name, f"a job of higher priority asks for {asked:g} CPU(s) more than "
                                                     f"the pool has free; told to finish its unit of work, SIGTERM "
                                                     f"after {master.preempt_grace_s:g} s")
        events += more + master.carry_out(decisions)
        owed -= cpus
    return events
