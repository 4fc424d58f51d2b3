"""Online updates: exact least squares with forgetting, lower error after a drift, growth on detection."""

from __future__ import annotations

import numpy as np

from convoy.workloads.gbdt import OrthogonalBoostingClassifier, OrthogonalBoostingRegressor
from convoy.workloads.gbdt.drift import PageHinkley
from convoy.workloads.gbdt.losses import LOSSES
from convoy.workloads.gbdt.online import OnlineWeights

SMALL = {"n_learners": 40, "min_data_in_leaf": 20, "growth_rows": 1000, "learners_per_drift": 5}


def stream(rows: int, drifted: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Friedman-like rows; after the drift x3's sign flips and x5 starts to matter."""
    rng = np.random.default_rng(seed)
    features = rng.uniform(size=(rows, 6))
    x = features.T
    slope, extra = (-8.0, 10.0) if drifted else (10.0, 0.0)
    target = 10 * np.sin(np.pi * x[0] * x[1]) + 20 * (x[2] - 0.5) ** 2 + slope * x[3] + 5 * x[4] + extra * x[5]
    return features, target + rng.normal(0, 1.0, rows)


def rmse(model: OrthogonalBoostingRegressor, features: np.ndarray, target: np.ndarray) -> float:
    return float(np.sqrt(np.mean((model.predict(features) - target) ** 2)))


def feed(model: object, features: np.ndarray, target: np.ndarray, batch_rows: int = 250) -> None:
    for begin in range(0, len(target), batch_rows):
        model.partial_fit(features[begin:begin + batch_rows], target[begin:begin + batch_rows])


def test_online_weights_without_forgetting_equal_batch_ridge_least_squares() -> None:
    rng = np.random.default_rng(0)
    outputs = np.column_stack([np.ones(900), rng.normal(size=(900, 5))])
    target = outputs @ rng.normal(size=6) + rng.normal(size=900)
    loss = LOSSES["squared"]
    online = OnlineWeights.start(loss, outputs[:300], target[:300], np.zeros(6), forgetting=1.0, ridge=0.01)
    for begin in range(300, 900, 100):
        online.update(loss, outputs[begin:begin + 100], target[begin:begin + 100])
    penalty = np.eye(6) * 0.01 * 900
    penalty[0, 0] = 0
    np.testing.assert_allclose(online.weights, np.linalg.solve(outputs.T @ outputs + penalty, outputs.T @ target),
                               rtol=1e-10)
    assert online.gram.shape == (6, 6) and online.rows == 900


def test_forgetting_follows_a_changed_relation() -> None:
    rng = np.random.default_rng(1)
    outputs = np.column_stack([np.ones(4000), rng.normal(size=(4000, 2))])
    target = np.where(np.arange(4000) < 2000, outputs @ [0.0, 1.0, 2.0], outputs @ [0.0, -1.0, 3.0])
    loss = LOSSES["squared"]
    online = OnlineWeights.start(loss, outputs[:2000], target[:2000], np.zeros(3), forgetting=0.99, ridge=0.0)
    for begin in range(2000, 4000, 100):
        online.update(loss, outputs[begin:begin + 100], target[begin:begin + 100])
    np.testing.assert_allclose(online.weights, [0.0, -1.0, 3.0], atol=1e-3)


def test_online_updates_reduce_error_on_drifted_data() -> None:
    train = stream(3000, drifted=False, seed=0)
    after, test = stream(4000, drifted=True, seed=1), stream(2000, drifted=True, seed=2)
    model = OrthogonalBoostingRegressor(**SMALL).fit(*train)
    weights_only = OrthogonalBoostingRegressor(**{**SMALL, "learners_per_drift": 0}).fit(*train)
    stale = rmse(model, *test)
    feed(model, *after)
    feed(weights_only, *after)
    assert rmse(weights_only, *test) < 0.8 * stale  # new weights alone help ...
    assert rmse(model, *test) < 0.8 * rmse(weights_only, *test)  # ... new orthogonal learners help more
    assert model.drifts_ >= 1 and model.n_learners_ > 40 and weights_only.n_learners_ == 40
    assert model.rows_seen_ == 4000


def test_no_growth_without_a_drift() -> None:
    train, more = stream(3000, drifted=False, seed=3), stream(4000, drifted=False, seed=4)
    model = OrthogonalBoostingRegressor(**SMALL).fit(*train)
    feed(model, *more)
    assert model.drifts_ == 0 and model.n_learners_ == 40


def test_classifier_recovers_after_a_drift() -> None:
    def labels(features: np.ndarray, drifted: bool, seed: int) -> np.ndarray:
        sign = -1.0 if drifted else 1.0
        logit = sign * 6 * (features[:, 0] - 0.5) + 4 * (features[:, 1] - 0.5) + (5 * (features[:, 5] - 0.5) * drifted)
        return (np.random.default_rng(seed).uniform(size=len(features)) < 1 / (1 + np.exp(-logit))).astype(int)

    rng = np.random.default_rng(5)
    train, after, test = (rng.uniform(size=(rows, 6)) for rows in (3000, 4000, 2000))
    model = OrthogonalBoostingClassifier(**SMALL).fit(train, labels(train, False, 6))
    test_labels = labels(test, True, 7)

    def log_loss() -> float:
        probability = np.clip(model.predict_proba(test)[:, 1], 1e-9, 1 - 1e-9)
        return float(-np.mean(test_labels * np.log(probability) + (1 - test_labels) * np.log(1 - probability)))

    stale = log_loss()
    feed(model, after, labels(after, True, 8))
    assert log_loss() < 0.7 * stale and model.drifts_ >= 1
    assert set(np.unique(model.predict(test))) <= {0, 1}


def test_page_hinkley_flags_a_jump_and_ignores_noise() -> None:
    detector = PageHinkley()  # the defaults the estimators use
    noise = np.random.default_rng(6).normal(1.0, 0.1, size=2000)
    assert not any(detector.update(float(value)) for value in noise)
    assert any(detector.update(3.0) for _ in range(3))
    restored = PageHinkley(**detector.state())
    assert restored.state() == detector.state()
