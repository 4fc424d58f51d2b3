"""What the buffer measures and holds: rates over a window, Reverb's rate limiter (the throttle mode's reference),
and the pacer that holds samples per insert by the size of each learner's batch, with nobody waiting."""

from __future__ import annotations

import pytest

from convoy.errors import ConfigError
from convoy.workloads.rl.rates import Pacer, RateMeter, Throttle


def test_rates_are_per_second_over_the_window() -> None:
    meter = RateMeter(window_s=2.0)
    assert meter.rates(2) == (0.0, 0.0)
    for tick in range(11):
        meter.note(tick * 0.5, tick * 100, tick * 400)
    assert meter.rates(2) == pytest.approx((200.0, 800.0))
    meter.note(6.0, 1000, 4000)  # nothing moved for a second: the window's rate falls
    inserts, samples = meter.rates(2)
    assert inserts < 200 and samples < 800


def test_the_throttle_lets_each_side_go_only_within_its_band() -> None:
    throttle = Throttle(target=2.0, min_size=10, error=8.0)
    assert throttle.may_insert(0, 0, 10) and not throttle.may_sample(9, 0, 1)
    assert throttle.may_sample(10, 0, 4) and throttle.may_sample(10, 4, 4) and not throttle.may_sample(10, 8, 4)
    assert throttle.may_insert(10, 0, 4) and not throttle.may_insert(10, 0, 5)  # 30 - 0 > 20 + 8
    throttle.check(8, inserting=True, inserted=10)
    throttle.check(50, inserting=True, inserted=0)  # before min_size every insert goes
    with pytest.raises(ConfigError, match="can never let an insert of 9 through: raise throttle_error to at least 9"):
        throttle.check(9, inserting=True, inserted=10)
    with pytest.raises(ConfigError, match="target samples per insert must be > 0"):
        Throttle(target=0)


def test_the_pacer_holds_the_ratio_by_batch_size_and_catches_up_after_a_stall() -> None:
    pacer = Pacer()
    inserted, sampled = 1000, 0
    assert pacer.count(4.0, 64, inserted, sampled) == 16  # nothing owed yet: the smallest batch
    sampled += 16
    for _ in range(200):  # actors insert 32 a step of the learner's: 128 owed per step, 64 asked
        inserted += 32
        got = pacer.count(4.0, 64, inserted, sampled)
        assert 16 <= got <= 256
        sampled += got
    owed = 4.0 * (inserted - 1000) - sampled
    assert abs(owed) <= 256, "the learners keep up by taking larger batches"
    inserted += 32 * 50  # a stall: the learner asked nothing while the actors went on
    taken = [pacer.count(4.0, 64, inserted, sampled)]
    sampled += taken[0]
    assert taken[0] == 256, "a learner behind takes the largest batch until it has caught up"
    with pytest.raises(ConfigError):
        pacer.count(0.0, 64, inserted, sampled)
