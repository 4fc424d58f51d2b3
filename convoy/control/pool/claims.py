"""The claims of the jobs that share one pool of CPUs and memory (this machine's), and what follows from them (pure).

Each job (and each ``convoy preempt``) keeps one claim: its priority, the CPUs and memory its processes hold, the
part of them it cannot give back (its elastic roles at MIN, its groups whole), and what it asks for beyond what it
holds. When jobs of higher priority ask for more than is free, the jobs below them give back down to their floor,
the lowest priority first (then the newest claim first); a job places a process only where its CPUs and memory are
free of what is held and of what higher priorities ask for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

EPSILON = 1e-9
GIB = float(1 << 30)


@dataclass(frozen=True)
class Amount:
    """CPUs and memory (bytes) together: what a process takes, a job holds, or the pool has."""

    cpus: float = 0.0
    memory: float = 0.0

    def __add__(self, other: Amount) -> Amount:
        return Amount(self.cpus + other.cpus, self.memory + other.memory)

    def __sub__(self, other: Amount) -> Amount:
        return Amount(self.cpus - other.cpus, self.memory - other.memory)

    def clipped(self) -> Amount:
        """No part below 0."""
        return Amount(max(0.0, self.cpus), max(0.0, self.memory))

    def least(self, other: Amount) -> Amount:
        return Amount(min(self.cpus, other.cpus), min(self.memory, other.memory))

    def any(self) -> bool:
        """Whether some part is above 0 (memory counts from a byte)."""
        return self.cpus > EPSILON or self.memory >= 1.0

    def within(self, other: Amount) -> bool:
        """Whether every part fits in ``other``."""
        return self.cpus <= other.cpus + EPSILON and self.memory <= other.memory + 0.5

    def helps(self, owed: Amount) -> bool:
        """Whether giving this back covers some of ``owed``."""
        return (self.cpus > EPSILON and owed.cpus > EPSILON) or (self.memory >= 1.0 and owed.memory >= 1.0)

    def describe(self) -> str:
        parts = [f"{self.cpus:g} CPU(s)"] if self.cpus > EPSILON else []
        parts += [f"{self.memory / GIB:.2f} GiB"] if self.memory >= 1.0 else []
        return " and ".join(parts) or "nothing"


def total(amounts: Iterable[Amount]) -> Amount:
    result = Amount()
    for amount in amounts:
        result = result + amount
    return result


@dataclass(frozen=True)
class Claim:
    job_id: str
    priority: int
    held: Amount = field(default_factory=Amount)
    """What its running processes hold."""
    floor: Amount = field(default_factory=Amount)
    """Of ``held``, what it cannot give back (elastic roles at their MIN, groups whole)."""
    wants: Amount = field(default_factory=Amount)
    """What it asks for beyond ``held`` (processes waiting for room; what ``convoy preempt`` stands for)."""
    since: float = 0.0
    """When the claim was made (wall clock): among equal priorities the newest gives back first."""
    pid: int = 0
    """The process that keeps the claim (a master, a ``convoy preempt``): a claim whose process is gone is dropped."""
    run_dir: str = ""


@dataclass(frozen=True)
class PoolView:
    """The pool as one job sees it: its capacity and every live claim."""

    capacity: Amount
    claims: tuple[Claim, ...]

    @property
    def held(self) -> Amount:
        return total(claim.held for claim in self.claims)

    @property
    def free(self) -> Amount:
        return (self.capacity - self.held).clipped()

    def claim(self, job_id: str) -> Claim | None:
        return next((claim for claim in self.claims if claim.job_id == job_id), None)


def room_for(view: PoolView, job_id: str, priority: int) -> Amount:
    """What ``job_id`` may take now: what no one holds, less what jobs of higher priority ask for."""
    above = total(claim.wants for claim in view.claims if claim.priority > priority and claim.job_id != job_id)
    return (view.free - above).clipped()


def give_back(view: PoolView, job_id: str) -> Amount:
    """What ``job_id`` must give back now: where jobs of higher priority than its own ask for more than is free, the
    jobs below the highest of them give back down to their floor, lowest priority first, then the newest claim
    first, until the deficit is covered; this job's share of that (nothing where it need give nothing)."""
    mine = view.claim(job_id)
    if mine is None:
        return Amount()
    askers = [claim for claim in view.claims if claim.wants.any() and claim.priority > mine.priority]
    deficit = (total(claim.wants for claim in askers) - view.free).clipped()
    if not askers or not deficit.any():
        return Amount()
    top = max(claim.priority for claim in askers)
    givers = sorted((claim for claim in view.claims if claim.priority < top),
                    key=lambda claim: (claim.priority, -claim.since, claim.job_id))
    for claim in givers:
        share = (claim.held - claim.floor).clipped().least(deficit)
        if claim.job_id == job_id:
            return share
        deficit = (deficit - share).clipped()
        if not deficit.any():
            break
    return Amount()


def describe(claims: Sequence[Claim]) -> list[str]:
    """``convoy pool``'s rows, highest priority first."""
    rows = sorted(claims, key=lambda claim: (-claim.priority, claim.since))
    return [f"  {claim.job_id:<24} priority {claim.priority:<4} holds {claim.held.describe()} (floor "
            f"{claim.floor.describe()}), asks {claim.wants.describe()} more; pid {claim.pid}"
            + (f", {claim.run_dir}" if claim.run_dir else "") for claim in rows]
