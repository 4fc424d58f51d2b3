"""The rate controller's decisions, a pure function of the measured rates: the slower side grows within its
MAX and the room left, else the faster side shrinks; learners change only after an imbalance lasts; nothing
moves inside the tolerance or while a change settles."""

from __future__ import annotations

import pytest

from convoy.errors import ConfigError
from convoy.workloads.rl.scaling import Bounds, Decision, RateController, Rates, ScalingPolicy


def policy(**overrides: object) -> ScalingPolicy:
    base: dict[str, object] = {"target": 4.0, "actors": Bounds(1, 8), "learners": Bounds(1, 3), "tolerance": 0.1,
                               "learner_patience": 3, "settle_ticks": 0}
    return ScalingPolicy(**{**base, **overrides})  # type: ignore[arg-type]


def test_learners_outpacing_actors_get_more_actors_in_proportion() -> None:
    controller = RateController(policy())
    decision = controller.decide(Rates(inserts_per_s=100, samples_per_s=800, actors=2, learners=1))
    assert decision == Decision("actor", 4, "800 samples/s over 100 inserts/s = 8.00 samples per insert, target 4: "
                                           "more actors to insert (2 -> 4)")


def test_within_the_tolerance_nothing_moves() -> None:
    controller = RateController(policy())
    assert controller.decide(Rates(100, 430, 2, 1)) is None
    assert controller.decide(Rates(100, 370, 2, 1)) is None


def test_actors_at_their_most_make_the_learners_fewer_after_the_imbalance_lasts() -> None:
    controller = RateController(policy(actors=Bounds(1, 2)))
    rates = Rates(inserts_per_s=100, samples_per_s=900, actors=2, learners=3)
    assert controller.decide(rates) is None and controller.decide(rates) is None
    decision = controller.decide(rates)
    assert decision is not None and (decision.role, decision.count) == ("learner", 1)
    assert "fewer learners: the actors can grow no further (3 -> 1)" in decision.reason


def test_actors_outpacing_learners_get_more_learners_once_it_lasts() -> None:
    controller = RateController(policy())
    rates = Rates(inserts_per_s=400, samples_per_s=800, actors=4, learners=1)
    assert [controller.decide(rates) for _ in range(2)] == [None, None]
    decision = controller.decide(rates)
    assert decision is not None and (decision.role, decision.count) == ("learner", 2)


def test_no_room_for_learners_makes_the_actors_fewer_at_once() -> None:
    controller = RateController(policy())
    decision = controller.decide(Rates(400, 800, 4, 1), pending=frozenset({"learner"}))
    assert decision is not None and (decision.role, decision.count) == ("actor", 2)


def test_a_change_settles_before_the_rates_are_judged_again() -> None:
    controller = RateController(policy(settle_ticks=2))
    assert controller.decide(Rates(100, 800, 2, 1)) is not None
    assert controller.decide(Rates(100, 800, 2, 1)) is None
    assert controller.decide(Rates(100, 800, 2, 1)) is None
    assert controller.decide(Rates(100, 800, 2, 1)) is not None


def test_a_streak_broken_by_a_balanced_tick_starts_again() -> None:
    controller = RateController(policy(actors=Bounds(1, 2)))
    high, even = Rates(100, 900, 2, 3), Rates(100, 400, 2, 3)
    assert [controller.decide(r) for r in (high, high, even, high, high)] == [None] * 5
    assert controller.decide(high) is not None


def test_counts_stay_within_bounds_and_nothing_is_decided_while_a_side_has_no_rate() -> None:
    controller = RateController(policy(actors=Bounds(1, 3)))
    decision = controller.decide(Rates(10, 4000, 1, 1))
    assert decision is not None and decision.count == 3
    assert RateController(policy()).decide(Rates(0, 0, 1, 1)) is None
    assert RateController(policy()).decide(Rates(100, 0, 1, 1)) is None


@pytest.mark.parametrize(("overrides", "error"), [
    ({"target": 0.0}, "target samples per insert must be a positive number"),
    ({"target": -1.0}, "target samples per insert must be a positive number"),
    ({"target": float("nan")}, "target samples per insert must be a positive number"),
    ({"actors": Bounds(4, 2)}, r"role actor: MIN:MAX 4:2 needs 1 <= MIN <= MAX"),
    ({"learners": Bounds(0, 2)}, r"role learner: MIN:MAX 0:2"),
    ({"tolerance": 1.5}, "tolerance must be in"),
])
def test_a_bad_policy_is_named(overrides: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        RateController(policy(**overrides))


def test_a_growth_of_the_learners_that_does_not_raise_their_rate_is_taken_back_and_not_tried_again() -> None:
    controller = RateController(policy(learner_patience=1, trial_ticks=2, min_gain=0.1))
    grown = controller.decide(Rates(inserts_per_s=100, samples_per_s=200, actors=8, learners=1))
    assert grown is not None and (grown.role, grown.count) == ("learner", 2)
    assert controller.decide(Rates(100, 150, 8, 1)) is None, "the group forms again: not judged yet"
    assert controller.decide(Rates(100, 210, 8, 2)) is None, "one tick at the new count"
    taken_back = controller.decide(Rates(100, 210, 8, 2))
    assert taken_back == Decision("learner", 1, "2 learners sample 210/s where 1 sampled 200/s (less than 10% "
                                                "more): the growth is taken back, and the learners stay at 1 or "
                                                "fewer (2 -> 1)")
    assert controller.decide(Rates(100, 200, 8, 1)) == Decision(
        "actor", 4, "200 samples/s over 100 inserts/s = 2.00 samples per insert, target 4: fewer actors: the learners "
                    "can grow no further (8 -> 4)"), "the imbalance remains: the actors give way, the learners stay"


def test_a_growth_of_the_learners_that_pays_is_kept() -> None:
    controller = RateController(policy(learner_patience=1, trial_ticks=2))
    assert controller.decide(Rates(100, 200, 8, 1)) is not None
    assert controller.decide(Rates(100, 300, 8, 2)) is None, "on trial: nothing else for the learners meanwhile"
    grown = controller.decide(Rates(100, 300, 8, 2))
    assert controller.learner_cap is None, "50% more samples: kept"
    assert grown is not None and (grown.role, grown.count) == ("learner", 3), "still short: it may grow again"
