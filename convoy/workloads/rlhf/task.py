"""The task whose reward can rise on a CPU in minutes: small arithmetic with a checkable answer, prompts made on the
fly from their number (every process makes the same prompt from the same number, so only numbers travel), a
held-out set of problems no training prompt asks, and a checker that gives 1 for the right number and 0 otherwise.

The problems (``a op b``) are split once by the task's seed: a fifth of them are held out, and training prompts
(numbers 0, 1, 2, ...) are drawn only from the rest, each by a generator seeded by (task seed, number). The held-out
set is the held-out problems in a fixed order (numbers -1, -2, ...): no held-out problem is ever a training prompt,
so the evaluation measures what generalises, not what was seen.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from convoy.errors import ConfigError

ANSWER = re.compile(r"-?\d+")
HELD_OUT_EVERY = 5
"""One problem in this many is held out."""
Problem = tuple[int, str, int]


@dataclass(frozen=True)
class Prompt:
    number: int
    text: str
    answer: int


@dataclass(frozen=True)
class Arithmetic:
    """``a op b`` with operands in [low, high] and ``ops`` among + - *."""

    seed: int = 0
    low: int = 2
    high: int = 30
    ops: str = "+-"

    training: tuple[Problem, ...] = field(init=False, repr=False, compare=False)
    held: tuple[Problem, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.low <= self.high or not self.ops or set(self.ops) - set("+-*"):
            raise ConfigError(f"an arithmetic task needs low <= high and ops among '+-*', got {self.low}, "
                              f"{self.high}, {self.ops!r}")
        every = [(a, op, b) for op in self.ops for a in range(self.low, self.high + 1)
                 for b in range(self.low, self.high + 1)]
        if len(every) < HELD_OUT_EVERY:
            raise ConfigError(f"the task has {len(every)} problem(s): it needs at least {HELD_OUT_EVERY}, one held "
                              "out; widen low..high or add ops")
        held = set(random.Random(self.seed * 7_919 + 17).sample(range(len(every)), len(every) // HELD_OUT_EVERY))
        object.__setattr__(self, "training", tuple(p for i, p in enumerate(every) if i not in held))
        object.__setattr__(self, "held", tuple(p for i, p in enumerate(every) if i in held))

    def prompt(self, number: int) -> Prompt:
        """Training prompt ``number`` (>= 0); negative numbers are the held-out set's."""
        if number < 0:
            return _made(number, self.held[(-1 - number) % len(self.held)])
        return _made(number, random.Random(self.seed * 1_000_003 + number).choice(self.training))

    def held_out(self, count: int) -> list[Prompt]:
        """Up to ``count`` prompts of held-out problems, each problem once (numbers -1, -2, ...)."""
        if count < 1:
            raise ConfigError(f"a held-out set needs at least one prompt, got {count}")
        return [self.prompt(-1 - i) for i in range(min(count, len(self.held)))]


def _made(number: int, problem: Problem) -> Prompt:
    a, op, b = problem
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return Prompt(number, f"What is {a} {op} {b}? Answer with the number only.", answer)


def reward(response: str, answer: int) -> float:
    """1 if the response's first number is the answer, else 0."""
    found = ANSWER.search(response)
    return 1.0 if found is not None and int(found.group()) == answer else 0.0
