"""The snapshot's overhead budget: k as a pure function of a snapshot's measured cost and the step's time, the
phases that measure both (a fake clock), a new k when the cost changes, bad budgets refused (the Checkpointer with
``max_overhead``: tests/unit/test_checkpointer.py)."""

from __future__ import annotations

import pytest
import torch

import convoy
from convoy.errors import CheckpointError
from convoy.runtime.snapshot_budget import MEASURE, RECHECK, WARMUP, SnapshotBudget, checked_budget, every_for


@pytest.mark.parametrize(("cost_s", "step_s", "budget", "every"), [
    (0.010, 0.100, 0.02, 5),     # 10% a snapshot: every 5th step is 2%
    (0.004, 0.100, 0.02, 2),     # exactly 2% at k = 2
    (0.0041, 0.100, 0.02, 3),    # just over: the next k
    (0.001, 0.100, 0.02, 1),     # 1%: every step
    (-0.002, 0.100, 0.02, 1),    # noise: a snapshot measured as free
    (0.050, 0.0, 0.02, 1),       # no step time known
    (0.055, 0.330, 0.05, 4),     # the GPU run's 55 ms of a 330 ms step, at 5%
])
def test_k_is_the_smallest_whose_share_of_the_training_is_within_the_budget(cost_s: float, step_s: float,
                                                                             budget: float, every: int) -> None:
    assert every_for(cost_s, step_s, budget) == every


def drive(budget: SnapshotBudget, calls: int, step_s: float, cost_s: float) -> list[bool]:
    """``calls`` step() calls on a fake clock: each interval is the step, plus the cost where the call before took a
    snapshot; the ranks' agreement is this one rank's own proposal."""
    taken, last = [], None
    for _ in range(calls):
        if last is not None:
            budget.observe(step_s + (cost_s if last else 0.0), last)
        last = budget.due()
        if budget.deciding():
            budget.settle(budget.propose())
        taken.append(last)
    return taken


def test_it_warms_up_measures_both_kinds_then_snapshots_every_kth_step() -> None:
    budget = SnapshotBudget(0.02)
    taken = drive(budget, WARMUP + MEASURE + 20, step_s=0.100, cost_s=0.010)
    assert taken[:WARMUP] == [True] * WARMUP
    assert taken[WARMUP:WARMUP + MEASURE] == [True, False] * (MEASURE // 2)
    assert budget.every == 5 and taken[WARMUP + MEASURE:] == ([False] * 4 + [True]) * 4
    decision = budget.decision
    assert decision is not None and decision.cost_s == pytest.approx(0.010) and decision.step_s == pytest.approx(0.1)
    assert decision.overhead == pytest.approx(0.02)
    assert decision.describe() == ("snapshots every 5 step(s): one costs 10.0 ms of a 100.0 ms step (10.0%), so "
                                   "2.00% of the training's time (budget 2.00%); a failure may cost up to 4 "
                                   "finished step(s)")


def test_a_cheaper_snapshot_brings_k_down_at_the_next_check_and_a_dearer_one_up() -> None:
    budget = SnapshotBudget(0.02)
    drive(budget, WARMUP + MEASURE, step_s=0.100, cost_s=0.010)
    assert budget.every == 5
    drive(budget, RECHECK * 2, step_s=0.100, cost_s=0.0015)  # the window holds only the cheaper ones by then
    assert budget.every == 1
    changed = None
    for _ in range(RECHECK * 2):  # at k = 1 only intervals with a snapshot come: the last step time measured stands
        budget.observe(0.100 + 0.030, True)
        budget.due()
        if budget.deciding():
            changed = budget.settle(budget.propose()) or changed
    assert budget.every == 15 and changed is not None and changed.every == 15


def test_a_budget_outside_0_to_1_is_refused_by_name() -> None:
    for bad in (0.0, 1.0, -0.02, 2.0):
        with pytest.raises(CheckpointError, match=rf"max_overhead .* got {bad}; None snapshots every step"):
            SnapshotBudget(bad)


def test_a_budget_and_an_interval_together_are_refused() -> None:
    """Refused before anything is made (no process group is asked for)."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"give every \(3\) or max_overhead \(0.02\), not both"):
        convoy.Checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), every=3, max_overhead=0.02)
    with pytest.raises(CheckpointError, match="max_overhead is the share"):
        convoy.Checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), max_overhead=5)
    with pytest.raises(CheckpointError, match="max_overhead is the share"):
        checked_budget(0.0)
    assert checked_budget(None) is None and checked_budget(0.02) == 0.02


def test_a_recheck_that_keeps_k_keeps_the_decision_that_was_announced() -> None:
    """New medians at the same k change nothing said: ``decision`` is the last one the events carried."""
    budget = SnapshotBudget(0.02)
    drive(budget, WARMUP + MEASURE, step_s=0.100, cost_s=0.010)
    announced = budget.decision
    assert announced is not None and announced.every == 5
    drive(budget, RECHECK * 2, step_s=0.101, cost_s=0.0099)  # a little different, still k = 5
    assert budget.every == 5 and budget.decision is announced
