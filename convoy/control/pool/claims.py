"""The claims of the jobs that share one pool of CPUs (this machine's), and what follows from them (pure).

Each job (and each ``convoy preempt``) keeps one claim: its priority, the CPUs its processes hold, the part of them
it cannot give back (its elastic roles at MIN, its fixed roles whole), and the CPUs it asks for beyond what it holds.
When jobs of higher priority ask for more than is free, the jobs below them give back down to their floor, the
lowest priority first (then the newest claim first); a job places a process only where the CPUs are free of what is
held and of what higher priorities ask for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

EPSILON = 1e-9


@dataclass(frozen=True)
class Claim:
    job_id: str
    priority: int
    held: float = 0.0
    """CPUs its running processes hold."""
    floor: float = 0.0
    """Of ``held``, what it cannot give back (elastic roles at their MIN, fixed roles whole)."""
    wants: float = 0.0
    """CPUs it asks for beyond ``held`` (processes waiting for room; what ``convoy preempt`` stands for)."""
    since: float = 0.0
    """When the claim was made (wall clock): among equal priorities the newest gives back first."""
    pid: int = 0
    """The process that keeps the claim (a master, a ``convoy preempt``): a claim whose process is gone is dropped."""
    run_dir: str = ""


@dataclass(frozen=True)
class PoolView:
    """The pool as one job sees it: its capacity and every live claim."""

    capacity: float
    claims: tuple[Claim, ...]

    @property
    def held(self) -> float:
        return sum(claim.held for claim in self.claims)

    @property
    def free(self) -> float:
        return max(0.0, self.capacity - self.held)

    def claim(self, job_id: str) -> Claim | None:
        return next((claim for claim in self.claims if claim.job_id == job_id), None)


def room_for(view: PoolView, job_id: str, priority: int) -> float:
    """CPUs ``job_id`` may take now: what no one holds, less what jobs of higher priority ask for."""
    above = sum(claim.wants for claim in view.claims if claim.priority > priority and claim.job_id != job_id)
    return max(0.0, view.free - above)


def give_back(view: PoolView, job_id: str) -> float:
    """CPUs ``job_id`` must give back now: where jobs of higher priority than its own ask for more than is free, the
    jobs below the highest of them give back down to their floor, lowest priority first, then the newest claim
    first, until the deficit is covered; this job's share of that (0 where it need give nothing)."""
    mine = view.claim(job_id)
    if mine is None:
        return 0.0
    askers = [claim for claim in view.claims if claim.wants > EPSILON and claim.priority > mine.priority]
    deficit = sum(claim.wants for claim in askers) - view.free
    if not askers or deficit <= EPSILON:
        return 0.0
    top = max(claim.priority for claim in askers)
    givers = sorted((claim for claim in view.claims if claim.priority < top),
                    key=lambda claim: (claim.priority, -claim.since, claim.job_id))
    for claim in givers:
        share = min(max(0.0, claim.held - claim.floor), deficit)
        if claim.job_id == job_id:
            return share
        deficit -= share
        if deficit <= EPSILON:
            break
    return 0.0


def describe(claims: Sequence[Claim]) -> list[str]:
    """``convoy pool``'s rows, highest priority first."""
    rows = sorted(claims, key=lambda claim: (-claim.priority, claim.since))
    return [f"  {claim.job_id:<24} priority {claim.priority:<4} holds {claim.held:g} CPU(s) (floor {claim.floor:g}), "
            f"asks {claim.wants:g} more; pid {claim.pid}" + (f", {claim.run_dir}" if claim.run_dir else "")
            for claim in rows]
