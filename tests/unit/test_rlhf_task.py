"""The arithmetic task: the same number makes the same prompt in every process, the held-out set never meets the
training prompts, and the checker rewards exactly the right first number."""

from __future__ import annotations

import pytest

from convoy.errors import ConfigError
from convoy.workloads.rlhf.task import Arithmetic, reward


def test_a_prompt_is_made_the_same_from_its_number_and_answered_right() -> None:
    task = Arithmetic(seed=7, ops="+-*")
    assert task.prompt(12) == Arithmetic(seed=7, ops="+-*").prompt(12)
    assert task.prompt(12) != Arithmetic(seed=8, ops="+-*").prompt(12)
    for number in range(200):
        made = task.prompt(number)
        a, op, b = made.text.split("?")[0].removeprefix("What is ").split()
        assert made.answer == eval(f"{a} {op} {b}")  # noqa: S307 (two small integers and an operator)


def test_no_held_out_problem_is_ever_a_training_prompt() -> None:
    task = Arithmetic(seed=1, low=1, high=12, ops="+")
    held = task.held_out(1000)
    assert len(held) == len({p.text for p in held}) == 144 // 5, "each held-out problem once, a fifth of them"
    assert {p.number for p in held} == set(range(-len(held), 0))
    assert {p.text for p in held}.isdisjoint(task.prompt(number).text for number in range(5000))
    assert len({task.prompt(number).text for number in range(5000)}) == 144 - len(held), "the rest all asked"
    assert Arithmetic(seed=2, low=1, high=12, ops="+").held_out(1000) != held, "the split follows the seed"
    with pytest.raises(ConfigError, match="at least one"):
        task.held_out(0)
    with pytest.raises(ConfigError, match="the task has 1 problem\\(s\\): it needs at least 5"):
        Arithmetic(low=3, high=3, ops="+")


@pytest.mark.parametrize("response, answer, expected", [
    ("42", 42, 1.0), (" The answer is 42.", 42, 1.0), ("-7", -7, 1.0), ("41", 42, 0.0), ("forty-two", 42, 0.0),
    ("4 + 38 = 42", 42, 0.0), ("", 3, 0.0),
])
def test_the_checker_takes_the_first_number(response: str, answer: int, expected: float) -> None:
    assert reward(response, answer) == expected


def test_a_task_that_cannot_be_made_is_refused() -> None:
    with pytest.raises(ConfigError, match="low <= high"):
        Arithmetic(low=5, high=2)
    with pytest.raises(ConfigError, match="ops among"):
        Arithmetic(ops="/")
