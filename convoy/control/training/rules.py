"""Training rules: the status points of all ranks of a job judged for NaN, divergence, plateau and throughput or
memory regressions; a condition that appears becomes one ``Proposal`` (target config, rollback step, evidence in
numbers). Pure: no I/O, no clock, no torch; bounded memory (a few thousand points per rank, running aggregates)."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from itertools import islice, takewhile
from statistics import median
from typing import Any

from convoy.config import STATUS_RULES as RULES
from convoy.errors import ConfigError

_Step = tuple[int, float, tuple[int, ...], "_Summary"]
"""A kept loss step: (step, mean loss, the ranks that reported it, the summary of the steps before it)."""
MAX_POINTS = 4096
"""Points kept per rank (the newest by step); older ones live on only in the running aggregates."""
LOSS_STEPS = 256
"""A step's mean loss folds into the running aggregates once the newest step is this far past it (then final)."""


@dataclass(frozen=True)
class Point:
    """One training status report of one rank after one step: ``time`` is when the step ended (the worker's
    clock; the rules read none), ``memory_bytes`` the process's RSS after it; any field may be missing."""

    rank: int
    step: int
    time: float
    loss: float | None = None
    step_time_s: float | None = None
    samples_per_s: float | None = None
    memory_bytes: int | None = None
    grad_norm: float | None = None


@dataclass(frozen=True)
class ConfigVersion:
    """A version of the training config: number 1 is the initial, ``at_step`` its first step (0 for the initial)."""

    number: int
    at_step: int
    values: dict[str, Any]


@dataclass
class RuleConfig:
    """The rules' thresholds."""

    divergence_factor: float = 5.0
    """Divergence: the mean loss over the ranks is above this many times its running minimum ..."""
    divergence_steps: int = 2
    """... for this many reported steps in a row (so an injected 100x learning rate is caught within 5 steps)."""
    warmup_steps: int = 20
    """No divergence, plateau or regression verdict on the first this many steps (of the job; of a rank)."""
    plateau_steps: int = 200
    """Plateau: the running minimum of the mean loss gained no more than ``plateau_rel`` in this many steps ..."""
    plateau_rel: float = 0.01
    """... (a relative gain), counted from its last such gain or the newest config change."""
    throughput_drop: float = 0.3
    """Throughput: a rank's median step time over its last ``window`` steps is above (1 + this) x its baseline,
    the median of its first ``window`` steps after warmup or after the newest config change."""
    memory_growth: float = 0.2
    """Memory: a rank's newest RSS is above (1 + this) x its baseline (the median, taken as for throughput)."""
    window: int = 20
    """Steps in a baseline and in the throughput rule's recent median."""
    auto_apply: frozenset[str] = frozenset()
    """The rules whose proposals are applied without a person (opt-in per rule)."""

    def validate(self) -> None:
        whole = ("divergence_steps", "warmup_steps", "plateau_steps", "window")
        for name, low, high in (("divergence_steps", 1, LOSS_STEPS // 2), ("warmup_steps", 0, 10**9),
                                ("plateau_steps", 1, 10**9), ("window", 1, MAX_POINTS // 4), ("plateau_rel", 0, 1),
                                ("divergence_factor", 1, math.inf), ("throughput_drop", 0, math.inf),
                                ("memory_growth", 0, math.inf)):
            value, kind = getattr(self, name), int if name in whole else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or not (
                    low <= value <= high if name in whole else low < value < high):
                want = f"a whole number from {low} to {high}" if name in whole else f"a number above {low}"
                raise ConfigError(f"rule config: {name} is {value!r}; it must be {want}"
                                  + (f" and below {high}" if name not in whole and high < math.inf else ""))
        if unknown := sorted(set(self.auto_apply) - set(RULES)):
            raise ConfigError(f"rule config: auto_apply names unknown rules {unknown}; the rules: {', '.join(RULES)}")


@dataclass
class Proposal:
    """A config change the rules suggest: ``values`` only the fields to change ({} when there is nothing to
    suggest), ``rollback_to`` a step to restart from (the newest checkpoint at or before it) or None."""

    rule: str
    step: int
    """The newest step that shows the condition; ``onset`` the first (None: ``step``); ``ranks`` those showing it."""
    evidence: str
    values: dict[str, Any]
    rollback_to: int | None
    auto: bool
    onset: int | None = None
    ranks: tuple[int, ...] = ()

    def key(self) -> str:
        """A stable id for deduplication: the rule and its onset (and the ranks, for the per-rank rules)."""
        tail = f":ranks {_ranks_text(self.ranks)}" if self.rule in ("throughput", "memory") else ""
        return f"{self.rule}:{self.step if self.onset is None else self.onset}{tail}"


@dataclass(frozen=True)
class _Summary:
    """Folded loss steps: the running minimum, and the plateau's reference (the minimum at its last improvement)."""

    last_step: int = -1
    min_loss: float = math.inf
    min_step: int = -1
    ref_loss: float = math.inf
    ref_step: int = -1


def _advance(summary: _Summary, step: int, mean: float, rel: float) -> _Summary:
    low, low_step = (mean, step) if mean < summary.min_loss else (summary.min_loss, summary.min_step)
    if summary.ref_step < 0 or low < summary.ref_loss - rel * abs(summary.ref_loss):
        return _Summary(step, low, low_step, low, step)
    return _Summary(step, low, low_step, summary.ref_loss, summary.ref_step)


@dataclass
class _Rank:
    """A rank's kept points (the newest ``MAX_POINTS``) and baselines (field -> median, first step, last step)."""

    steps: list[int] = field(default_factory=list)
    points: dict[int, Point] = field(default_factory=dict)
    floor: int = 0
    first_step: int | None = None
    base_start: int = -1
    baselines: dict[str, tuple[float, int, int]] = field(default_factory=dict)

    def add(self, point: Point) -> bool:
        """Keep a point; False for a duplicate of a kept step or one older than the kept ones."""
        if point.step < self.floor or point.step in self.points:
            return False
        self.points[point.step] = point
        insort(self.steps, point.step)
        self.first_step = point.step if self.first_step is None else min(self.first_step, point.step)
        if len(self.steps) > MAX_POINTS + MAX_POINTS // 8:
            self.points = {step: self.points[step] for step in self.steps[-MAX_POINTS:]}
            self.steps, self.floor = self.steps[-MAX_POINTS:], self.steps[-MAX_POINTS]
        return True

    def truncate(self, step: int) -> None:
        while self.steps and self.steps[-1] > step:
            del self.points[self.steps.pop()]
        self.floor = min(self.floor, step + 1)
        self.first_step = None if self.first_step is None or self.first_step > step else self.first_step
        self.baselines = {name: base for name, base in self.baselines.items() if base[2] <= step}

    def newest(self, name: str, count: int, after: int) -> list[tuple[int, Any]]:
        """The newest ``count`` (step, value) of ``name`` after step ``after``, in step order; [] if fewer."""
        steps = takewhile(lambda step: step > after, reversed(self.steps))
        picked = list(islice(((s, v) for s in steps if (v := getattr(self.points[s], name)) is not None), count))
        return picked[::-1] if len(picked) == count else []

    def baseline(self, name: str, window: int) -> tuple[float, int, int] | None:
        """The median of ``name`` over the first ``window`` points from ``base_start`` (fixed once taken)."""
        steps = self.steps[bisect_left(self.steps, self.base_start):] if name not in self.baselines else []
        first = list(islice(((s, v) for s in steps if (v := getattr(self.points[s], name)) is not None), window))
        if len(first) == window:
            self.baselines[name] = (median(value for _, value in first), first[0][0], first[-1][0])
        return self.baselines.get(name)


def _finite(point: Point) -> bool:
    """Whether the point's loss and gradient norm are finite (where given)."""
    return all(value is None or math.isfinite(value) for value in (point.loss, point.grad_norm))


class _LossTrack:
    """The mean loss per step over the ranks that reported it: the last ``LOSS_STEPS`` steps, older ones folded."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.sums: dict[int, tuple[float, int, tuple[int, ...]]] = {}
        self.summary, self.first_step = _Summary(), None

    def add(self, point: Point) -> None:
        """Count a point's loss toward its step's mean, if finite (with a finite gradient norm where given)."""
        if point.loss is not None and point.step > self.summary.last_step and _finite(point):
            if point.step not in self.sums:
                insort(self.steps, point.step)
            total, count, ranks = self.sums.get(point.step, (0.0, 0, ()))
            self.sums[point.step] = (total + point.loss, count + 1, ranks + (point.rank,))
            self.first_step = point.step if self.first_step is None else min(self.first_step, point.step)

    def fold(self, rel: float) -> None:
        while self.steps and self.steps[0] <= self.steps[-1] - LOSS_STEPS:
            total, count, _ = self.sums.pop(step := self.steps.pop(0))
            self.summary = _advance(self.summary, step, total / count, rel)

    def walk(self, rel: float) -> tuple[list[_Step], _Summary]:
        """The kept steps, and the summary of all steps."""
        summary, out = self.summary, []
        for step in self.steps:
            total, count, ranks = self.sums[step]
            out.append((step, total / count, ranks, summary))
            summary = _advance(summary, step, total / count, rel)
        return out, summary

    def reset_after(self, step: int, ranks: dict[int, _Rank], rel: float) -> None:
        """Forget the steps after ``step``. Where folded steps go, refold from the points the ranks keep (the steps
        before those are forgotten too: for a falling loss their minimum is no lower)."""
        if self.summary.last_step > step:
            self.steps, self.sums, self.summary = [], {}, _Summary()
            for point in (state.points[kept] for state in ranks.values() for kept in state.steps):
                self.add(point)
            self.fold(rel)
        while self.steps and self.steps[-1] > step:
            del self.sums[self.steps.pop()]
        self.first_step = None if self.first_step is None or self.first_step > step else self.first_step


class Rules:
    """Judges the status points of a job's ranks. A condition is proposed once, when it appears; while it keeps
    holding it is not proposed again, and after it cleared it is (a new onset, a new key)."""

    def __init__(self, config: RuleConfig) -> None:
        config.validate()
        self.config = config
        self._ranks: dict[int, _Rank] = {}
        self._loss = _LossTrack()
        self._active: dict[str, int | None] = {"nan": None, "divergence": None, "plateau": None}  # onset, if holding
        self._rank_active: dict[str, dict[int, int]] = {"throughput": {}, "memory": {}}
        self._version_step = 0

    def kept_points(self, rank: int) -> int:
        return len(self._ranks[rank].steps) if rank in self._ranks else 0

    def kept_loss_steps(self) -> int:
        return len(self._loss.steps)

    def observe(self, points: list[Point], versions: list[ConfigVersion],
                checkpoint_steps: list[int] | tuple[int, ...] = ()) -> list[Proposal]:
        """Take new points (any order, any ranks; a (rank, step) already kept is ignored); return the new proposals.
        ``versions``: the config history; ``checkpoint_steps``: the persistent checkpoints there are."""
        versions = sorted(versions, key=lambda version: version.number)
        self._version_step = versions[-1].at_step if versions and versions[-1].number > 1 else 0
        bad: list[tuple[Point, str, float]] = []
        touched: dict[int, set[str]] = {}
        for point in sorted(points, key=lambda point: (point.step, point.rank)):
            if not self._ranks.setdefault(point.rank, _Rank()).add(point):
                continue
            touched.setdefault(point.rank, set()).update(
                name for name in ("step_time_s", "memory_bytes") if getattr(point, name) is not None)
            bad += [(point, name, getattr(point, name)) for name in ("loss", "grad_norm")
                    if getattr(point, name) is not None and not math.isfinite(getattr(point, name))]
            self._loss.add(point)
        self._loss.fold(self.config.plateau_rel)
        checkpoints, (series, summary) = list(checkpoint_steps), self._loss.walk(self.config.plateau_rel)
        found = [self._nan(bad, series, versions, checkpoints)]
        if series and self._loss.first_step is not None:
            warm = self._loss.first_step + self.config.warmup_steps
            found += [self._divergence(series, versions, checkpoints, warm),
                      self._plateau(series, summary, versions, warm)]
        return [proposal for proposal in found if proposal is not None] + self._regressions(touched)

    def reset_after(self, step: int) -> None:
        """The run restarts so that the steps after ``step`` run again: forget their points and what came of them."""
        for state in self._ranks.values():
            state.truncate(step)
        self._loss.reset_after(step, self._ranks, self.config.plateau_rel)
        self._active = {rule: None if onset is None or onset > step else onset for rule, onset in self._active.items()}
        self._rank_active = {rule: {rank: onset for rank, onset in active.items() if onset <= step}
                             for rule, active in self._rank_active.items()}

    def _proposal(self, rule: str, step: int, evidence: str, values: dict[str, Any], rollback_to: int | None,
                  onset: int, ranks: tuple[int, ...]) -> Proposal:
        return Proposal(rule, step, evidence, values, rollback_to, rule in self.config.auto_apply, onset,
                        tuple(sorted(set(ranks))))

    def _nan(self, bad: list[tuple[Point, str, float]], series: list[_Step], versions: list[ConfigVersion],
             checkpoints: list[int]) -> Proposal | None:
        """A NaN or inf loss or gradient norm, proposed at once; it clears when every rank's newest report is finite."""
        proposal = None
        if bad and self._active["nan"] is None:
            first, ranks = min(bad, key=lambda item: (item[0].step, item[0].rank)), tuple(p.rank for p, _, _ in bad)
            onset, step = first[0].step, max(point.step for point, _, _ in bad)
            good = next(((kept, mean) for kept, mean, _, _ in reversed(series) if kept < onset), None)
            evidence = (f"{first[1]} {first[2]} at step {onset} on rank {first[0].rank} (non-finite on ranks "
                        f"{_ranks_text(ranks)} up to step {step})"
                        + (f"; the newest finite mean loss is {good[1]:.4g} at step {good[0]}" if good else ""))
            proposal = self._revert("nan", step, onset, ranks, evidence, versions, checkpoints, good[0] if good else -1)
        newest = (next((p for p in map(state.points.get, reversed(state.steps)) if p and (p.loss is not None
                        or p.grad_norm is not None)), None) for state in self._ranks.values())
        if self._active["nan"] is not None and all(point is None or _finite(point) for point in newest):
            self._active["nan"] = None
        return proposal

    def _divergence(self, series: list[_Step], versions: list[ConfigVersion], checkpoints: list[int],
                    warm: int) -> Proposal | None:
        """The mean loss above ``divergence_factor`` x its running minimum for ``divergence_steps`` steps in a row."""
        run = []
        every = max(len(ranks) for _, _, ranks, _ in series[-self.config.window:])
        for step, mean, ranks, before in reversed(series):
            if len(ranks) < every:  # not every rank's loss is in yet: one rank's noise is no divergence
                continue
            if step < warm or before.min_loss <= 0 or not mean > self.config.divergence_factor * before.min_loss:
                break
            run.append((step, mean, ranks, before))
        if len(run) < self.config.divergence_steps:
            self._active["divergence"] = None
        if len(run) < self.config.divergence_steps or self._active["divergence"] is not None:
            return None
        step, mean, ranks, before = run[0]
        evidence = (f"loss {mean:.4g} at step {step} is {mean / before.min_loss:.3g}x its running minimum "
                    f"{before.min_loss:.4g} (step {before.min_step}), {len(run)} steps in a row on ranks "
                    f"{_ranks_text(ranks)}")
        return self._revert("divergence", step, run[-1][0], ranks, evidence, versions, checkpoints, None)

    def _plateau(self, series: list[_Step], summary: _Summary, versions: list[ConfigVersion],
                 warm: int) -> Proposal | None:
        """No gain of the running minimum by more than ``plateau_rel`` for ``plateau_steps`` steps."""
        newest, since = series[-1][0], max(summary.ref_step, self._version_step)
        onset = since + self.config.plateau_steps
        if newest < max(onset, warm):
            self._active["plateau"] = None
        if newest < max(onset, warm) or self._active["plateau"] == onset:
            return None
        values, why = _scaled_lr(versions, 0.5)
        evidence = (f"the running minimum of the mean loss, {summary.min_loss:.4g} (step {summary.min_step}), "
                    f"improved by no more than {self.config.plateau_rel:.2%} in the {newest - since} steps since step "
                    f"{since} (mean loss {series[-1][1]:.4g} at step {newest}){why}")
        self._active["plateau"] = onset
        return self._proposal("plateau", newest, evidence, values, None, onset, series[-1][2])

    def _revert(self, rule: str, step: int, onset: int, ranks: tuple[int, ...], evidence: str,
                versions: list[ConfigVersion], checkpoints: list[int], good_step: int | None) -> Proposal:
        """Revert the newest config change at or before ``onset`` (for NaN: one no older than the newest good loss),
        else cut the learning rate x 0.1; roll back to the newest checkpoint before the onset and that change."""
        culprit = next((v for v in reversed(versions) if v.number > 1 and v.at_step <= onset), None)
        previous = next((v for v in reversed(versions) if culprit and v.number < culprit.number), None)
        values, why, changed_at = *_scaled_lr(versions, 0.1), onset
        if culprit is not None and previous is not None and (good_step is None or culprit.at_step >= good_step):
            reverted = {name: previous.values[name] for name, value in culprit.values.items()
                        if name in previous.values and value != previous.values[name] != versions[-1].values.get(name)}
            if reverted:
                changed = ", ".join(f"{name} {reverted[name]!r} -> {culprit.values[name]!r}" for name in reverted)
                values, changed_at = reverted, culprit.at_step
                why = (f"; config version {culprit.number} (from step {culprit.at_step}) changed {changed}: revert to "
                       f"version {previous.number}'s values")
        self._active[rule] = onset
        rollback = max((kept for kept in checkpoints if kept < min(onset, changed_at)), default=None)
        return self._proposal(rule, step, evidence + why, values, rollback, onset, ranks)

    def _regressions(self, touched: dict[int, set[str]]) -> list[Proposal]:
        """Throughput and memory, per rank against its baseline: a proposal per rule for ranks newly showing it."""
        window, found = self.config.window, []
        for rank, state in self._ranks.items():
            warm = -1 if state.first_step is None else state.first_step + self.config.warmup_steps
            if (start := max(self._version_step, warm)) != state.base_start:
                state.base_start, state.baselines = start, {}
                for active in self._rank_active.values():
                    active.pop(rank, None)
        for rule, name, count, limit in (("throughput", "step_time_s", window, 1 + self.config.throughput_drop),
                                         ("memory", "memory_bytes", 1, 1 + self.config.memory_growth)):
            fired: list[tuple[int, int, str]] = []
            for rank in sorted(touched):
                base = self._ranks[rank].baseline(name, window) if name in touched[rank] else None
                if not base or not (newest := self._ranks[rank].newest(name, count, base[2])):
                    continue
                value, first, last = median(value for _, value in newest), newest[0][0], newest[-1][0]
                if not value > limit * base[0]:
                    self._rank_active[rule].pop(rank, None)
                elif rank not in self._rank_active[rule]:
                    self._rank_active[rule][rank], ratio = last, value / base[0] if base[0] else math.inf
                    what = (f"median step time {value:.4g} s over steps {first}-{last}" if rule == "throughput" else
                            f"RSS {value / 2**20:,.0f} MiB at step {last}")
                    then = f"{base[0]:.4g} s" if rule == "throughput" else f"{base[0] / 2**20:,.0f} MiB"
                    fired.append((rank, last, f"rank {rank}: {what} is {ratio:.3g}x its baseline {then} (steps "
                                  f"{base[1]}-{base[2]})"))
            if fired:
                steps = [step for _, step, _ in fired]
                found.append(self._proposal(rule, max(steps), "; ".join(text for _, _, text in fired), {}, None,
                                            min(steps), tuple(rank for rank, _, _ in fired)))
        return found


def _scaled_lr(versions: list[ConfigVersion], factor: float) -> tuple[dict[str, Any], str]:
    """The config's float learning-rate field times ``factor``, or nothing to suggest."""
    current = versions[-1].values if versions else {}
    for name in ("lr", "learning_rate"):
        if isinstance(value := current.get(name), float) and math.isfinite(value):
            return {name: value * factor}, f"; suggest {name} {value:.4g} x {factor:g}"
    return {}, ""


def _ranks_text(ranks: tuple[int, ...]) -> str:
    """Ranks as ranges: (0, 1, 2, 3, 5) -> '0-3, 5'."""
    present = set(ranks)
    lows, highs = sorted(r for r in present if r - 1 not in present), sorted(r for r in present if r + 1 not in present)
    return ", ".join(f"{low}-{high}" if high > low else str(low) for low, high in zip(lows, highs, strict=True))
