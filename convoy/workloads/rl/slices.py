"""The environment's state space cut into slices, and the slices dealt to actors (pure: no processes, no torch).

A slice is a part of the space an actor explores on its own: by default a range of reset seeds, or a range of
levels or start-state boxes where an environment has them. The controller deals every slice to exactly one
actor; when actors come and go it moves as few slices as it can (an actor keeps what it had, up to its fair
share) so that each actor's episodes stay where they were. ``check_dealt`` is the invariant, checked after
every deal: every slice owned, none twice.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from convoy.errors import ConfigError


@dataclass(frozen=True)
class Slice:
    """Seeds (or levels) ``[start, stop)`` of the space, numbered ``index``."""

    index: int
    start: int
    stop: int

    def __contains__(self, seed: int) -> bool:
        return self.start <= seed < self.stop

    def seed(self, episode: int) -> int:
        """The reset seed of an actor's ``episode``-th episode in this slice (it cycles through the slice)."""
        return self.start + episode % (self.stop - self.start)


@dataclass(frozen=True)
class StartBox:
    """A box of initial states, numbered ``index``: an episode in it starts from a state drawn uniformly between
    ``low`` and ``high`` (for an environment whose start state can be set, e.g. gymnasium's classic control)."""

    index: int
    low: tuple[float, ...]
    high: tuple[float, ...]

    def draw(self, rng: random.Random) -> list[float]:
        return [rng.uniform(a, b) for a, b in zip(self.low, self.high, strict=True)]


def box_slices(low: Sequence[float], high: Sequence[float], axis: int, count: int) -> list[StartBox]:
    """The box ``[low, high]`` of initial states cut into ``count`` even boxes along ``axis``."""
    if len(low) != len(high) or not 0 <= axis < len(low):
        raise ConfigError(f"a start box needs low and high of one length and an axis within it; got {len(low)}, "
                          f"{len(high)} and axis {axis}")
    if count < 1 or not low[axis] < high[axis]:
        raise ConfigError(f"cannot cut [{low[axis]}, {high[axis]}] on axis {axis} into {count} boxes: give count >= 1 "
                          "and low < high")
    cuts = [low[axis] + (high[axis] - low[axis]) * i / count for i in range(count + 1)]
    cuts[-1] = high[axis]
    boxes = []
    for i in range(count):
        box_low, box_high = list(low), list(high)
        box_low[axis], box_high[axis] = cuts[i], cuts[i + 1]
        boxes.append(StartBox(i, tuple(box_low), tuple(box_high)))
    return boxes


def check_boxes(boxes: Sequence[StartBox], low: Sequence[float], high: Sequence[float]) -> None:
    """Boxes an environment declares must tile its box of initial states ``[low, high]``: numbered 0..n-1, each
    inside it and spanning it on every axis but one, where they follow each other with no gap and no overlap."""
    if not boxes:
        raise ConfigError("an environment declared no start boxes: declare at least one covering its start states")
    if sorted(b.index for b in boxes) != list(range(len(boxes))):
        raise ConfigError(f"start boxes must be numbered 0..{len(boxes) - 1}, got {sorted(b.index for b in boxes)}")
    cut = [axis for axis in range(len(low))
           if any((b.low[axis], b.high[axis]) != (low[axis], high[axis]) for b in boxes)]
    if any(len(b.low) != len(low) or len(b.high) != len(high) for b in boxes) or len(cut) > 1:
        raise ConfigError(f"start boxes must span [{list(low)}, {list(high)}] on every axis but one; they differ on "
                          f"axes {cut}")
    axis = cut[0] if cut else 0
    at = low[axis]
    for box in sorted(boxes, key=lambda b: b.low[axis]):
        if not box.low[axis] < box.high[axis]:
            raise ConfigError(f"start box {box.index} is empty on axis {axis}")
        if box.low[axis] != at:
            what = "overlaps the box before it" if box.low[axis] < at else f"leaves [{at}, {box.low[axis]}) uncovered"
            raise ConfigError(f"start box {box.index} {what} on axis {axis}")
        at = box.high[axis]
    if at != high[axis]:
        raise ConfigError(f"start boxes end at {at} on axis {axis}, not at the space's {high[axis]}")


def seed_slices(total: int, count: int) -> list[Slice]:
    """``total`` seeds cut into ``count`` slices as even as they come (the default cut of an environment)."""
    if count <= 0 or total < count:
        raise ConfigError(f"cannot cut {total} seeds into {count} slices: give 1 <= slices <= seeds")
    bounds = [total * i // count for i in range(count + 1)]
    return [Slice(i, bounds[i], bounds[i + 1]) for i in range(count)]


def check_cover(slices: Sequence[Slice], total: int) -> None:
    """Slices an environment declares must tile ``[0, total)``: numbered 0..n-1, none empty, no gap, no overlap."""
    if not slices:
        raise ConfigError("an environment declared no slices: declare at least one covering its seeds")
    if sorted(s.index for s in slices) != list(range(len(slices))):
        raise ConfigError(f"slices must be numbered 0..{len(slices) - 1}, got {sorted(s.index for s in slices)}")
    at = 0
    for piece in sorted(slices, key=lambda s: (s.start, s.stop)):
        if piece.stop <= piece.start:
            raise ConfigError(f"slice {piece.index} [{piece.start}, {piece.stop}) is empty")
        if piece.start < at:
            raise ConfigError(f"slice {piece.index} [{piece.start}, {piece.stop}) overlaps the seeds before {at}")
        if piece.start > at:
            raise ConfigError(f"seeds [{at}, {piece.start}) are in no slice: the slices must cover [0, {total})")
        at = piece.stop
    if at != total:
        raise ConfigError(f"seeds [{at}, {total}) are in no slice: the slices must cover [0, {total})"
                          if at < total else f"the slices reach seed {at}, past the space's {total}")


def deal(slices: Iterable[int], actors: Sequence[str],
         before: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Each slice to one of ``actors``, the counts differing by at most one, moving as few as possible from
    ``before`` (an actor keeps its own slices up to its share; an actor that left gives all of its back)."""
    pool = sorted(set(slices))
    if not actors:
        return {}
    order = sorted(actors, key=lambda a: (-len(before.get(a, ())), a))  # who held more keeps the larger share
    share = {actor: len(pool) // len(order) + (1 if i < len(pool) % len(order) else 0) for i, actor in enumerate(order)}
    kept: dict[str, list[int]] = {}
    taken: set[int] = set()
    for actor in order:
        mine = [s for s in before.get(actor, ()) if s in pool and s not in taken][:share[actor]]
        kept[actor] = mine
        taken.update(mine)
    free = [s for s in pool if s not in taken]
    for actor in order:
        while len(kept[actor]) < share[actor]:
            kept[actor].append(free.pop(0))
    return {actor: tuple(sorted(kept[actor])) for actor in actors}


def check_dealt(dealt: Mapping[str, Sequence[int]], slices: Iterable[int]) -> None:
    """The deal's invariant: every slice owned by exactly one actor (an AssertionError names the break)."""
    owners: dict[int, list[str]] = {}
    for actor, owned in dealt.items():
        for piece in owned:
            owners.setdefault(piece, []).append(actor)
    every = set(slices)
    unowned = sorted(every - set(owners))
    twice = {s: o for s, o in owners.items() if len(o) > 1}
    strangers = sorted(set(owners) - every)
    if dealt and (unowned or twice or strangers):
        raise AssertionError(f"slices dealt wrong: unowned {unowned}, owned twice {twice}, unknown {strangers}")


@dataclass
class SliceBook:
    """The controller's deal over time: who owns which slice, how many deals kept the invariant, and each
    slice's visits (episodes the actors report started in it)."""

    slices: Sequence[Slice | StartBox]
    dealt: dict[str, tuple[int, ...]] = field(default_factory=dict)
    deals: int = 0
    """Deals made (each checked by ``check_dealt``)."""
    moved: int = 0
    """Slices that changed owner over all deals."""
    visits: dict[int, int] = field(default_factory=dict)

    def redeal(self, actors: Sequence[str]) -> dict[str, tuple[int, ...]]:
        """Deal again for the actors now running; returns the new deal (checked)."""
        new = deal((s.index for s in self.slices), actors, self.dealt)
        check_dealt(new, (s.index for s in self.slices))
        owner_before = {s: a for a, owned in self.dealt.items() for s in owned}
        self.moved += sum(1 for a, owned in new.items() for s in owned if owner_before.get(s) not in (None, a))
        self.dealt, self.deals = new, self.deals + 1
        return new

    def visited(self, counts: Mapping[int, int]) -> None:
        """Add an actor's episode counts per slice (an index the space does not have is ignored)."""
        for index, count in counts.items():
            if 0 <= index < len(self.slices) and count > 0:
                self.visits[index] = self.visits.get(index, 0) + count
