"""The task whose reward can rise on a CPU in minutes: small arithmetic with a checkable answer, prompts made on the
fly from their number (every process makes the same prompt from the same number, so only numbers travel), a
held-out set of numbers no training prompt uses, and a checker that gives 1 for the right number and 0 otherwise.

A prompt's number picks its operands with a generator seeded by (task seed, number); training prompts are numbers
0, 1, 2, ...; held-out prompts are numbers below 0, so the two sets never meet.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from convoy.errors import ConfigError

ANSWER = re.compile(r"-?\d+")


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

    def __post_init__(self) -> None:
        if not self.low <= self.high or not self.ops or set(self.ops) - set("+-*"):
            raise ConfigError(f"an arithmetic task needs low <= high and ops among '+-*', got {self.low}, "
                              f"{self.high}, {self.ops!r}")

    def prompt(self, number: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + number)
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        op = rng.choice(self.ops)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        return Prompt(number, f"What is {a} {op} {b}? Answer with the number only.", answer)

    def held_out(self, count: int) -> list[Prompt]:
        """``count`` prompts no training prompt is (numbers -1, -2, ...)."""
        if count < 1:
            raise ConfigError(f"a held-out set needs at least one prompt, got {count}")
        return [self.prompt(-1 - i) for i in range(count)]


def reward(response: str, answer: int) -> float:
    """1 if the response's first number is the answer, else 0."""
    found = ANSWER.search(response)
    return 1.0 if found is not None and int(found.group()) == answer else 0.0
