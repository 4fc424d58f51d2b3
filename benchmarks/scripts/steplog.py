"""The per-rank step files that benchmark training scripts write, read while the job runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple


class Step(NamedTuple):
    rank: int
    step: int
    pid: int
    t: float
    round_id: int = 0


class StepLog:
    """The lines the training script appends to OUT/rank*.txt (``rank step pid time [round]``),
    read as the files grow."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.offsets: dict[Path, int] = {}
        self.steps: list[Step] = []

    def poll(self) -> None:
        for path in sorted(self.out.glob("rank*.txt")):
            with open(path, "rb") as handle:
                handle.seek(self.offsets.get(path, 0))
                data = handle.read()
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
            self.offsets[path] = self.offsets.get(path, 0) + end
            for line in data[:end].decode().splitlines():
                rank, step, pid, when, *rest = line.split()
                self.steps.append(Step(int(rank), int(step), int(pid), float(when), int(rest[0]) if rest else 0))
        self.steps.sort(key=lambda s: s.t)

    def first_per_rank(self, accept: Callable[[Step], bool], ranks: int) -> float | None:
        """The time by which each of ``ranks`` ranks has finished an accepted step (None if one has not)."""
        firsts: dict[int, float] = {}
        for step in self.steps:
            if accept(step):
                firsts.setdefault(step.rank, step.t)
        return max(firsts.values()) if len(firsts) == ranks else None

    def current(self) -> dict[int, Step]:
        """The latest step of each rank."""
        return {step.rank: step for step in self.steps}

    def last_step(self) -> int:
        return max((s.step for s in self.steps), default=-1)

    def pids(self) -> set[int]:
        return {s.pid for s in self.steps}

    def after(self, when: float, new_since: set[int] | None = None) -> list[Step]:
        """Steps finished after ``when``, only by workers not in ``new_since`` if given."""
        return [s for s in self.steps if s.t > when and (new_since is None or s.pid not in new_since)]


def first(steps: list[Step], accept: Callable[[Step], bool]) -> Step | None:
    return next((s for s in steps if accept(s)), None)


def steps_lost(steps: list[Step]) -> int:
    """Finished steps done again after a restart. A step is finished once every rank of the round has
    finished it (its ``ckpt.step()`` returned and its line was written): in a synchronous job a step that
    a rank was killed inside is not finished, and redoing it is the exact resume, not a loss."""
    ranks: dict[int, set[int]] = {}
    done: dict[tuple[int, int], set[int]] = {}
    for step in steps:
        ranks.setdefault(step.round_id, set()).add(step.rank)
        done.setdefault((step.round_id, step.step), set()).add(step.rank)
    finished = {}  # step -> the first round in which every rank of that round finished it
    for (round_id, number), by in sorted(done.items()):
        if by >= ranks[round_id]:
            finished.setdefault(number, round_id)
    return len({s.step for s in steps if s.step in finished and s.round_id > finished[s.step]})
