"""convoy.control.roles.memory_model: the one-iteration model, the learnt margin, placement, refusals, DLRover's
rule."""

from __future__ import annotations

import json
import random

import pytest

from convoy.control.roles.memory_model import (MIN_MARGIN, PRIOR_SPREAD, SPREAD_FACTOR, IterationShape, MarginModel,
                                               MeasuredIteration, check_limit, dlrover_after_oom, dlrover_allocation,
                                               place_workers, predict, relaunch_limit)
from convoy.errors import ConfigError

MIB = 1024 * 1024
CHIEF = IterationShape(state_bytes=400 * MIB, batch_size=256, sample_bytes=1024)
MEASURED = MeasuredIteration(CHIEF, peak_rss_bytes=900 * MIB, peak_uss_bytes=700 * MIB,
                             baseline_rss_bytes=300 * MIB, baseline_uss_bytes=150 * MIB)


def test_a_worker_like_the_chief_is_predicted_at_the_chiefs_peak() -> None:
    prediction = predict(MEASURED, CHIEF, margin=0.0)
    assert prediction.rss_bytes == 900 * MIB and prediction.uss_bytes == 700 * MIB
    assert prediction.limit_bytes == 900 * MIB
    assert prediction.activation_rss_bytes == 200 * MIB and prediction.baseline_rss_bytes == 300 * MIB


def test_measured_activations_scale_with_the_batch_bytes_and_the_overhead_does_not() -> None:
    measured = MeasuredIteration(CHIEF, 900 * MIB, 700 * MIB, 300 * MIB, 150 * MIB, activation_bytes=50 * MIB)
    bigger = IterationShape(state_bytes=100 * MIB, batch_size=1024, sample_bytes=512)  # twice the batch bytes
    prediction = predict(measured, bigger, margin=0.1)
    assert prediction.overhead_rss_bytes == 150 * MIB and prediction.activation_rss_bytes == 100 * MIB
    assert prediction.rss_bytes == (300 + 100 + 150 + 100) * MIB
    assert prediction.uss_bytes == (150 + 100 + 100 + 100) * MIB
    assert prediction.limit_bytes >= prediction.rss_bytes * 1.1 and prediction.limit_bytes % 4096 == 0
    smaller = IterationShape(state_bytes=400 * MIB, batch_size=64, sample_bytes=1024)
    assert predict(measured, smaller, 0.0).rss_bytes == (300 + 400 + 150) * MIB + 50 * MIB // 4


def test_without_measured_activations_the_rest_scales_up_never_down() -> None:
    bigger = IterationShape(state_bytes=100 * MIB, batch_size=1024, sample_bytes=512)
    assert predict(MEASURED, bigger, 0.0).rss_bytes == (300 + 100 + 400) * MIB
    smaller = IterationShape(state_bytes=400 * MIB, batch_size=16, sample_bytes=1024)
    assert predict(MEASURED, smaller, 0.0).rss_bytes == 900 * MIB, "a smaller batch keeps the chief's peak"


def test_a_peak_below_baseline_plus_state_predicts_no_activations() -> None:
    odd = MeasuredIteration(CHIEF, 500 * MIB, 400 * MIB, 300 * MIB, 150 * MIB)
    assert predict(odd, CHIEF, 0.0).rss_bytes == 700 * MIB


EXACT = MeasuredIteration(CHIEF, 900 * MIB, 700 * MIB, 300 * MIB, 150 * MIB, activation_bytes=200 * MIB)
"""The chief's iteration of the stand-in process below, its activations measured."""


def _true_peak(shape: IterationShape, rng: random.Random, noise: float) -> int:
    """A stand-in process whose real peak follows the model's form, with run-to-run noise."""
    exact = 300 * MIB + shape.state_bytes + 200 * MIB * shape.batch_bytes // CHIEF.batch_bytes
    return int(exact * (1 + rng.gauss(0, noise)))


def test_the_margin_starts_from_a_small_prior_and_learns_the_measured_spread() -> None:
    rng, model = random.Random(3), MarginModel()
    assert model.margin() == pytest.approx(SPREAD_FACTOR * PRIOR_SPREAD)
    assert model.margin() < 0.5, "not DLRover's fixed +50%"
    for _ in range(200):
        shape = IterationShape(rng.randint(50, 800) * MIB, rng.choice([64, 256, 1024, 4096]), 1024)
        model.record(predict(EXACT, shape, model.margin()).rss_bytes, _true_peak(shape, rng, noise=0.005))
    assert MIN_MARGIN <= model.margin() < 0.03, "precise predictions shrink the margin"
    model.record(1000 * MIB, 1200 * MIB)
    assert model.margin() >= 0.2 - 1e-9, "never below the worst underestimate seen"


def test_a_noisier_process_gets_a_wider_margin_and_limits_cover_its_peaks() -> None:
    rng, model = random.Random(7), MarginModel()
    covered = 0
    for _ in range(300):
        shape = IterationShape(rng.randint(50, 800) * MIB, rng.choice([64, 512, 4096]), 2048)
        prediction = predict(EXACT, shape, model.margin())
        peak = _true_peak(shape, rng, noise=0.03)
        covered += peak <= prediction.limit_bytes
        model.record(prediction.rss_bytes, peak)
    assert 0.05 < model.margin() < 0.15
    assert covered >= 0.97 * 300


def test_an_oom_kill_raises_the_margin_and_the_relaunch_limit() -> None:
    model = MarginModel()
    model.record_oom(predicted_bytes=1000 * MIB, limit_bytes=1060 * MIB, overshoot_bytes=0)
    assert model.margin() >= 0.06
    assert relaunch_limit(1060 * MIB, 0, model.margin()) >= 1060 * MIB * (1 + model.margin())
    assert relaunch_limit(1000 * MIB, 300 * MIB, 0.05) >= 1300 * MIB, "the measured overshoot when it is larger"


def test_the_margin_state_round_trips() -> None:
    model = MarginModel()
    model.record(100, 104)
    model.record(100, 97)
    again = MarginModel.from_state(json.loads(json.dumps(model.state())))
    assert again.margin() == model.margin() and again.errors == model.errors
    with pytest.raises(ConfigError, match="malformed"):
        MarginModel.from_state({"errors": []})


def test_a_limit_below_the_measured_need_is_refused_with_the_measurement() -> None:
    prediction = predict(MEASURED, CHIEF, 0.05)
    with pytest.raises(ConfigError) as caught:
        check_limit(512 * MIB, prediction, "worker")
    message = str(caught.value)
    assert "512.0 MiB" in message and "900.0 MiB" in message and "role worker" in message and "auto" in message
    check_limit(prediction.rss_bytes, prediction)


def test_workers_are_placed_where_they_fit() -> None:
    free = {"a": 10 * 1024 * MIB, "b": 3 * 1024 * MIB, "c": 500 * MIB}
    assert place_workers(free, 1024 * MIB) == {"a": 10, "b": 3, "c": 0}
    assert place_workers(free, 1024 * MIB, reserve_bytes=1024 * MIB) == {"a": 9, "b": 2, "c": 0}
    spread = place_workers(free, 1024 * MIB, requested=9)
    assert sum(spread.values()) == 9 and spread["c"] == 0 and spread["a"] >= spread["b"] > 0
    with pytest.raises(ConfigError, match="hold 13|holds 13"):
        place_workers(free, 1024 * MIB, requested=14)
    with pytest.raises(ConfigError, match="positive"):
        place_workers(free, 0)


@pytest.mark.parametrize("measured, worker, words", [
    (MEASURED, IterationShape(0, 0, 10), "batch_size"),
    (MEASURED, IterationShape(0, 1, 0), "sample_bytes"),
    (MEASURED, IterationShape(-1, 1, 1), "state_bytes"),
    (MeasuredIteration(CHIEF, 0, 0, 0, 0), CHIEF, "no memory sample"),
    (MeasuredIteration(CHIEF, 10, 20, 0, 0), CHIEF, "inconsistent"),
    (MeasuredIteration(CHIEF, 10, 5, -1, 0), CHIEF, "negative"),
    (MeasuredIteration(CHIEF, 10, 5, 0, 0, activation_bytes=-3), CHIEF, "activation_bytes"),
])
def test_bad_measurements_and_shapes_are_refused(measured, worker, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        predict(measured, worker, 0.05)


def test_dlrovers_rule_from_the_same_samples() -> None:
    used = [5000 * MIB, 5200 * MIB, 5100 * MIB, 6000 * MIB, 5900 * MIB, 5800 * MIB]
    assert dlrover_allocation(used) == int(1.5 * 6000 * MIB)
    assert dlrover_allocation([7000 * MIB] + used[1:]) == int(1.5 * 6000 * MIB), "only the latest 5 samples"
    assert dlrover_after_oom(1024) == 2048
    with pytest.raises(ConfigError):
        dlrover_allocation([])
