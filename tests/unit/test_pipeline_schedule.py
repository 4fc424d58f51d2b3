"""Pipeline schedules as data: generators, the validator's verdicts, and the simulator's numbers."""

from __future__ import annotations

import dataclasses

import pytest

from convoy.errors import ScheduleError
from convoy.parallel.pipeline import schedule as plans
from convoy.parallel.pipeline.fill import plan_fills
from convoy.parallel.pipeline.schedule import Action, Kind, Schedule
from convoy.parallel.pipeline.simulate import Costs, simulate
from convoy.parallel.pipeline.validate import validate


def F(s: int, mb: int, peer: int | None = None) -> Action:  # noqa: N802 - reads like the grid
    return Action(Kind.F, s, mb, peer)


def B(s: int, mb: int) -> Action:  # noqa: N802
    return Action(Kind.B, s, mb)


def edit(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    return dataclasses.replace(schedule, actions={**schedule.actions, rank: actions})


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9])
def test_every_generator_makes_valid_schedules(p: int, m: int) -> None:
    made = [plans.gpipe(p, m), plans.one_f_one_b(p, m), plans.two_group(p, m),
            plans.two_group(p, m, forward=1, backward=3, comm=0.2), plans.split_backward(plans.one_f_one_b(p, m))]
    if m % p == 0:
        made += [plans.interleaved(p, m), plans.interleaved(p, m, chunks=3)]
    for schedule in made:
        validate(schedule)
        assert sum(a.kind is Kind.F for acts in schedule.actions.values() for a in acts) == schedule.n_stages * m


@pytest.mark.parametrize("p,m", [(4, 8), (4, 4), (2, 6), (8, 16)])
def test_bubbles_match_the_textbook_formulas(p: int, m: int) -> None:
    classic = (p - 1) / (m + p - 1)
    assert simulate(plans.gpipe(p, m)).bubble == pytest.approx(classic)
    assert simulate(plans.one_f_one_b(p, m)).bubble == pytest.approx(classic)
    assert simulate(plans.interleaved(p, m)).bubble == pytest.approx((p - 1) / (2 * m + p - 1))
    # 1F1B holds at most p micro-batches of one stage (one model's worth), GPipe all m of them
    assert max(simulate(plans.one_f_one_b(p, m)).peak_activations.values()) == pytest.approx(1.0)
    assert max(simulate(plans.gpipe(p, m)).peak_activations.values()) == pytest.approx(m / p)


def test_two_group_cycles_follow_the_issue_order_with_steady_lags() -> None:
    lag = plans.two_group_offsets(4)
    assert [lag[0, r] for r in range(4)] == [0, 0, 0, 0]  # F1 passes down the ranks within a cycle
    assert [lag[2, r] for r in range(4)] == [1, 1, 1, 1]
    assert [lag[3, r] for r in range(4)] == [4, 3, 2, 1]  # each backward hop against the skew costs a cycle
    assert [lag[1, r] for r in range(4)] == [8, 7, 6, 5]
    schedule = plans.two_group(4, 12)
    rank1 = [a for a in schedule.actions[1] if a.compute]
    first_b1 = rank1.index(B(1, 0))
    steady = rank1[first_b1 - 1:first_b1 + 3]  # a full cycle: F1, B1 (an earlier mb), F2, B2
    assert [(a.kind, a.stage) for a in steady] == [(Kind.F, 1), (Kind.B, 1), (Kind.F, 5), (Kind.B, 5)]
    assert [a.mb for a in steady] == [t - lag[phase, 1] for t in [steady[0].mb] for phase in (0, 1, 2, 3)]
    result = simulate(schedule)
    assert result.bubble < simulate(plans.one_f_one_b(4, 12)).bubble
    # planned for slow messages, the lags change and the plan is no slower under them
    slow = Costs(comm=1.0)
    assert plans.two_group_offsets(4, comm=1.0) != lag
    assert simulate(plans.two_group(4, 12, comm=1.0), slow).makespan <= simulate(schedule, slow).makespan


def test_simulator_times_a_two_stage_pipeline_by_hand() -> None:
    # stage forward 1, backward 2, each message 0.5: F0 0-1, F1 1.5-2.5, B1 2.5-4.5, B0 5-7
    result = simulate(plans.one_f_one_b(2, 1), Costs(forward=2, backward=4, comm=0.5))
    assert result.makespan == pytest.approx(7.0)
    assert result.busy == {0: pytest.approx(3.0), 1: pytest.approx(3.0)}
    assert result.bubble == pytest.approx(1 - 6 / 14)
    spans = {str(s.action): (s.start, s.end) for s in result.spans}
    assert spans["1F0"] == (1.5, 2.5) and spans["0B0"] == (5.0, 7.0)


def test_split_forward_costs_owner_and_helper_their_shares() -> None:
    base = plans.gpipe(2, 1)
    owner = [F(0, 0, peer=1)] + base.actions[0][1:]
    helper = [Action(Kind.H, 0, 0, peer=0)] + base.actions[1]
    filled = validate(edit(edit(base, 0, owner), 1, helper))
    costs = Costs(forward=2, backward=4, fill_comm=0.1, fill_params=0.2)
    spans = {str(s.action): (s.start, s.end) for s in simulate(filled, costs).spans}
    # the parameters arrive at 0.2 (the input at 0.1); the helper's half (0.5) is back at 0.8
    assert spans["0F0@1"] == pytest.approx((0.0, 0.8))
    assert spans["0H0@0"] == pytest.approx((0.2, 0.7))
    assert spans["1F0"][0] == pytest.approx(0.8)
    # two blocks, two exchanges: the second input leaves when the first block is whole (0.55)
    spans = {str(s.action): (s.start, s.end) for s in simulate(filled, dataclasses.replace(costs, fill_rounds=2)).spans}
    assert spans["0F0@1"] == pytest.approx((0.0, 1.0)) and spans["0H0@0"] == pytest.approx((0.2, 0.9))
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(0F0@1\): helper rank 1 has no H"):
        validate(edit(base, 0, owner))


@pytest.mark.parametrize("change,message", [
    (lambda s: edit(s, 0, [B(0, 0)] + s.actions[0]), r"rank 0, action 0 \(0B0\): comes before the F"),
    (lambda s: edit(s, 0, s.actions[0] + [F(0, 0)]), r"runs a second time"),
    (lambda s: edit(s, 0, s.actions[0] + [F(1, 0)]), r"\(1F0\): stage 1 is placed on rank 1"),
    (lambda s: edit(s, 0, s.actions[0] + [F(0, 9)]), r"\(0F9\): there is no micro-batch 9"),
    (lambda s: edit(s, 1, [a for a in s.actions[1] if a.kind is not Kind.RECV_F]),
     r"rank 1, action 0 \(1F0\): its input is not received"),
    (lambda s: edit(s, 0, [a for a in s.actions[0] if str(a) != "0B1"]), r"stage 0 micro-batch 1 has no backward"),
    (lambda s: edit(s, 0, [Action(Kind.SEND_F, 0, 0)] + [a for a in s.actions[0] if str(a) != "0SEND_F0"]),
     r"\(0SEND_F0\): sends before the F"),
    (lambda s: edit(s, 0, s.actions[0] + [Action(Kind.RECV_F, 0, 0)]), r"\(0RECV_F0\): no such message"),
])
def test_validator_names_the_first_offending_action(change, message) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(change(plans.one_f_one_b(2, 2)))


def test_validator_finds_deadlocks() -> None:
    # rank 0 waits for 0's gradient before it sends micro-batch 1's activation, which rank 1 needs first
    base = plans.gpipe(2, 2)
    rank1 = [Action(Kind.RECV_F, 1, 1), F(1, 1), Action(Kind.RECV_F, 1, 0), F(1, 0), B(1, 0),
             Action(Kind.SEND_B, 1, 0), B(1, 1), Action(Kind.SEND_B, 1, 1)]
    rank0 = [F(0, 0), Action(Kind.SEND_F, 0, 0), Action(Kind.RECV_B, 0, 0), B(0, 0), F(0, 1),
             Action(Kind.SEND_F, 0, 1), Action(Kind.RECV_B, 0, 1), B(0, 1)]
    with pytest.raises(ScheduleError, match=r"deadlock: .*rank 0, action 2 \(0RECV_B0\).*rank 1, action 0"):
        validate(edit(edit(base, 0, rank0), 1, rank1))


def test_bad_shapes_are_refused_with_what_to_do() -> None:
    with pytest.raises(ScheduleError, match="at least 1 micro-batch"):
        plans.one_f_one_b(4, 0)
    with pytest.raises(ScheduleError, match="not a multiple of 4"):
        plans.interleaved(4, 6)
    with pytest.raises(ScheduleError, match="8 stages but the model has only 6 layers"):
        plans.check_shape(4, 8, n_layers=6, chunks=2)
    with pytest.raises(ScheduleError, match="3 micro-batches do not divide the batch of 16"):
        plans.split_microbatches(16, 3)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        plans.build("zb", 4, 8)
    assert plans.split_microbatches(16, 4) == 4


def test_grid_prints_one_row_per_rank() -> None:
    grid = plans.one_f_one_b(2, 2).grid()
    assert grid.splitlines()[1].split()[2:] == ["0F0", "0F1", "0B0", "0B1"]
    assert "1F0" in grid.splitlines()[2] and "SEND" not in grid
    assert "0SEND_F0" in plans.one_f_one_b(2, 2).grid(comms=True)


def test_fills_are_planned_only_where_the_simulator_says_they_pay() -> None:
    schedule = plans.one_f_one_b(4, 8)
    cheap = Costs(comm=0.01, fill_comm=0.01, fill_params=0.01)
    filled, result = plan_fills(schedule, cheap)
    helpers = [(rank, a) for rank, acts in filled.actions.items() for a in acts if a.kind is Kind.H]
    assert helpers and filled.name == "1f1b+fill"
    assert result.makespan < simulate(schedule, cheap).makespan
    assert result.makespan == pytest.approx(simulate(filled, cheap).makespan)
    for rank, help_action in helpers:  # every helper was idle, in the unfilled step, while it helps
        owner = filled.placement[help_action.stage]
        assert rank != owner and help_action.peer == owner
        assert any(a.kind is Kind.F and a.peer == rank and a.stage == help_action.stage for a in filled.actions[owner])
    # the warm-up forwards of the first micro-batch are the ones worth splitting
    assert {(a.stage, a.mb) for _, a in helpers} <= {(s, 0) for s in range(4)} | {(s, 1) for s in range(4)}
    pricey = Costs(comm=0.01, fill_comm=0.05, fill_params=0.2)
    unfilled, same = plan_fills(schedule, pricey)
    assert unfilled.name == "1f1b" and same.makespan == pytest.approx(simulate(schedule, pricey).makespan)
    only_last, _ = plan_fills(schedule, cheap, fillable=[3])
    assert all(a.stage == 3 for acts in only_last.actions.values() for a in acts if a.kind is Kind.H)
