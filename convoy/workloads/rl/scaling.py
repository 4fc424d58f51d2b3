"""Rate-driven scaling of an RL job's actors and learners (pure: rates in, a decision out, no processes).

The balance that matters is samples per insert: transitions the learners sample for each one the actors insert.
Each tick the controller hands ``RateController.decide`` the rates measured over the last window and the roles'
counts; it answers with at most one change: the slower side grows (as far as its MAX and the room left for it),
else the faster side shrinks to match. A change to the learners re-forms their group, so it waits until the
imbalance has lasted ``learner_patience`` ticks; after any change the controller waits ``settle_ticks`` for the
new processes' rates before it judges again. The decision names the rates that caused it.

More learners need not sample more: on a machine whose cores the actors, the buffer and the learners share, a
second learner can slow the pair (its gradients' all-reduce, its share of the CPUs). So a growth of the learners is
a trial: once the grown group has sampled for ``trial_ticks``, a rate that did not rise by ``min_gain`` takes the
growth back, and the learners are not grown past that count again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from convoy.errors import ConfigError


@dataclass(frozen=True)
class Bounds:
    """A role's MIN:MAX."""

    minimum: int
    maximum: int

    def clamp(self, count: int) -> int:
        return max(self.minimum, min(self.maximum, count))


@dataclass(frozen=True)
class ScalingPolicy:
    target: float
    """Samples per insert to hold (DQN's replay ratio: e.g. 8 = each transition sampled 8 times on average)."""
    actors: Bounds
    learners: Bounds
    tolerance: float = 0.1
    """How far (a fraction of ``target``) the measured ratio may stray before the controller acts."""
    learner_patience: int = 3
    """Ticks an imbalance must last before the learners' count changes (it re-forms their group)."""
    settle_ticks: int = 2
    """Ticks to wait after a change before the rates are judged again (the new processes start)."""
    trial_ticks: int = 5
    """Ticks the grown learners sample at their new count before their rate is compared with the one before."""
    min_gain: float = 0.1
    """The rise of the learners' rate (a fraction) a growth must bring to stay."""

    def validate(self) -> None:
        if not (self.target > 0 and math.isfinite(self.target)):
            raise ConfigError(f"the target samples per insert must be a positive number, got {self.target!r}")
        if not 0 < self.tolerance < 1:
            raise ConfigError(f"the tolerance must be in (0, 1), got {self.tolerance!r}")
        for name, bounds in (("actor", self.actors), ("learner", self.learners)):
            if bounds.minimum < 1 or bounds.minimum > bounds.maximum:
                raise ConfigError(f"role {name}: MIN:MAX {bounds.minimum}:{bounds.maximum} needs 1 <= MIN <= MAX")
        if self.learner_patience < 1 or self.settle_ticks < 0 or self.trial_ticks < 1 or self.min_gain < 0:
            raise ConfigError("learner_patience and trial_ticks must be >= 1, settle_ticks and min_gain >= 0")


@dataclass(frozen=True)
class Rates:
    """What the replay buffer measured over the last window."""

    inserts_per_s: float
    samples_per_s: float
    """What the learners sample a second, or ask for at their nominal batch where the buffer paces them."""
    actors: int
    """Actor processes running (inserting) in the window."""
    learners: int
    """Learner processes running (sampling) in the window."""

    @property
    def ratio(self) -> float | None:
        """Samples per insert; None while nothing was inserted."""
        return self.samples_per_s / self.inserts_per_s if self.inserts_per_s > 0 else None


@dataclass(frozen=True)
class Decision:
    role: str
    """``actor`` or ``learner``."""
    count: int
    """The role's new count."""
    reason: str
    """Why, with the rates that caused it (the event's text)."""


class RateController:
    """One decision per tick from the measured rates; ``pending`` roles (processes asked for but not placed: no
    room for them) are not grown further."""

    def __init__(self, policy: ScalingPolicy) -> None:
        policy.validate()
        self.policy = policy
        self._streak = 0
        """Consecutive ticks the ratio was off in the same direction (+: too many samples per insert)."""
        self._quiet = 0
        """Ticks left before the rates are judged again, after a change."""
        self._trial: tuple[int, int, float] | None = None
        """A growth of the learners on trial: (count before, count after, their rate before)."""
        self._trial_seen = 0
        """Ticks the grown learners have sampled at their new count."""
        self.learner_cap: int | None = None
        """The learners' count a growth past which did not pay."""

    def decide(self, rates: Rates, pending: frozenset[str] = frozenset()) -> Decision | None:
        policy, ratio = self.policy, rates.ratio
        if self._trial is not None:
            judged = self._judge(rates)
            if judged is not None:
                return judged
        if self._quiet > 0:
            self._quiet -= 1
            return None
        if ratio is None or rates.samples_per_s <= 0 or rates.actors < 1 or rates.learners < 1:
            self._streak = 0
            return None  # warming up: a side that has not run yet gives no rate to scale by
        high, low = policy.target * (1 + policy.tolerance), policy.target * (1 - policy.tolerance)
        direction = 1 if ratio > high else -1 if ratio < low else 0
        self._streak = self._streak + direction if direction and self._streak * direction >= 0 else direction
        if direction == 0:
            return None
        per_actor = rates.inserts_per_s / rates.actors
        per_learner = rates.samples_per_s / rates.learners
        said = (f"{rates.samples_per_s:.0f} samples/s over {rates.inserts_per_s:.0f} inserts/s = {ratio:.2f} "
                f"samples per insert, target {policy.target:g}")
        if direction > 0:  # the learners outpace the actors
            grow = ("actor", rates.actors, policy.actors.clamp(math.ceil(
                rates.samples_per_s / policy.target / per_actor)), "more actors to insert")
            shrink = ("learner", rates.learners, policy.learners.clamp(math.floor(
                policy.target * rates.inserts_per_s / per_learner)), "fewer learners: the actors can grow no further")
        else:  # the actors outpace the learners
            grow = ("learner", rates.learners, policy.learners.clamp(math.ceil(
                policy.target * rates.inserts_per_s / per_learner)), "more learners to sample")
            shrink = ("actor", rates.actors, policy.actors.clamp(math.floor(
                rates.samples_per_s / policy.target / per_actor)), "fewer actors: the learners can grow no further")
        role, now, wanted, why = grow
        if role == "learner" and self.learner_cap is not None:
            wanted = min(wanted, max(now, self.learner_cap))
        if role == "learner" and self._trial is not None:
            return None  # the learners' growth is on trial: nothing to take from the actors until it is judged
        if wanted > now and role not in pending:
            decision = self._change(role, now, wanted, f"{said}: {why}")
            if decision is not None and role == "learner":
                self._trial, self._trial_seen = (now, wanted, rates.samples_per_s), 0
            return decision
        role, now, wanted, why = shrink
        if wanted < now and not (role == "learner" and self._trial is not None):
            return self._change(role, now, wanted, f"{said}: {why}")
        return None

    def _judge(self, rates: Rates) -> Decision | None:
        """The trial of a growth of the learners: once they have sampled ``trial_ticks`` at their new count, keep it
        if their rate rose by ``min_gain``, else take it back (and grow them no further)."""
        assert self._trial is not None
        before, after, rate_before = self._trial
        self._trial_seen = self._trial_seen + 1 if rates.learners == after else 0
        if self._trial_seen < self.policy.trial_ticks:
            return None
        self._trial = None
        if rates.samples_per_s >= rate_before * (1 + self.policy.min_gain):
            return None
        self.learner_cap = before
        self._quiet, self._streak = self.policy.settle_ticks, 0
        return Decision("learner", before, f"{after} learners sample {rates.samples_per_s:.0f}/s where {before} "
                                           f"sampled {rate_before:.0f}/s (less than {self.policy.min_gain:.0%} more): "
                                           f"the growth is taken back, and the learners stay at {before} or fewer "
                                           f"({after} -> {before})")

    def _change(self, role: str, now: int, wanted: int, why: str) -> Decision | None:
        if role == "learner" and abs(self._streak) < self.policy.learner_patience:
            return None  # not yet: a learner change re-forms the group
        self._quiet, self._streak = self.policy.settle_ticks, 0
        return Decision(role, wanted, f"{why} ({now} -> {wanted})")
