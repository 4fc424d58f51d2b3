"""Bad input gets a GBDTError (a ConvoyError) that says what is wrong, never a NumPy or LightGBM traceback."""

from __future__ import annotations

import numpy as np
import pytest

from convoy.errors import ConvoyError
from convoy.workloads.gbdt import (
    GBDTDataError, GBDTError, GBDTModelError, OrthogonalBoostingClassifier, OrthogonalBoostingRegressor,
)

SMALL = {"n_learners": 10, "min_data_in_leaf": 20}


@pytest.fixture(scope="module")
def fitted() -> OrthogonalBoostingRegressor:
    rng = np.random.default_rng(0)
    features = rng.uniform(size=(500, 3))
    return OrthogonalBoostingRegressor(**SMALL).fit(features, features @ [1.0, 2.0, 3.0])


def test_errors_are_convoy_errors() -> None:
    assert issubclass(GBDTDataError, GBDTError) and issubclass(GBDTModelError, GBDTError)
    assert issubclass(GBDTError, ConvoyError)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_features_are_rejected_with_their_position(bad: float) -> None:
    features = np.ones((100, 3))
    features[7, 2] = bad
    with pytest.raises(GBDTDataError, match="row 7, column 2"):
        OrthogonalBoostingRegressor(**SMALL).fit(features, np.ones(100))


def test_non_finite_targets_are_rejected(fitted: OrthogonalBoostingRegressor) -> None:
    target = np.ones(50)
    target[3] = np.nan
    with pytest.raises(GBDTDataError, match="NaN/inf.*row 3"):
        fitted.partial_fit(np.ones((50, 3)), target)


def test_mismatched_feature_counts_between_train_and_update(fitted: OrthogonalBoostingRegressor) -> None:
    with pytest.raises(GBDTDataError, match="4 features but the model was trained on 3"):
        fitted.partial_fit(np.ones((10, 4)), np.ones(10))
    with pytest.raises(GBDTDataError, match="trained on 3"):
        fitted.predict(np.ones((10, 2)))


def test_empty_batches_are_rejected(fitted: OrthogonalBoostingRegressor) -> None:
    with pytest.raises(GBDTDataError, match="empty"):
        fitted.partial_fit(np.zeros((0, 3)), np.zeros(0))
    with pytest.raises(GBDTDataError, match="empty"):
        fitted.predict(np.zeros((0, 3)))


def test_target_length_must_match_the_rows(fitted: OrthogonalBoostingRegressor) -> None:
    with pytest.raises(GBDTDataError, match="9 values for 10 rows"):
        fitted.partial_fit(np.ones((10, 3)), np.ones(9))


@pytest.mark.parametrize("labels, message", [
    (np.arange(100) % 3, "exactly 2 distinct values, got 3"),
    (np.ones(100), "exactly 2 distinct values, got 1"),
    (np.linspace(0, 1, 100), "got 100"),
])
def test_the_classifier_needs_a_binary_target(labels: np.ndarray, message: str) -> None:
    with pytest.raises(GBDTDataError, match=message):
        OrthogonalBoostingClassifier(**SMALL).fit(np.random.default_rng(1).uniform(size=(100, 3)), labels)


def test_the_classifier_rejects_new_labels_in_updates() -> None:
    features = np.random.default_rng(2).uniform(size=(300, 3))
    model = OrthogonalBoostingClassifier(**SMALL).fit(features, (features[:, 0] > 0.5).astype(int))
    with pytest.raises(GBDTDataError, match=r"target values \[2\] are not among the classes the model was fitted on"):
        model.partial_fit(features[:5], [0, 1, 2, 1, 0])
    with pytest.raises(GBDTDataError, match=r"not among the classes.*\[0, 1\]"):
        model.partial_fit(features[:2], ["yes", "no"])
    with pytest.raises(GBDTDataError, match="NaN/inf"):
        model.partial_fit(features[:2], [0.0, np.nan])


def test_using_an_unfitted_model_says_to_fit_first() -> None:
    with pytest.raises(GBDTModelError, match="not fitted yet"):
        OrthogonalBoostingRegressor().predict(np.ones((2, 2)))
    with pytest.raises(GBDTModelError, match="not fitted yet"):
        OrthogonalBoostingRegressor().partial_fit(np.ones((2, 2)), np.ones(2))


@pytest.mark.parametrize("setting, message", [
    ({"n_learners": 0}, "n_learners"), ({"ridge": -1.0}, "ridge"), ({"forgetting": 1.5}, "forgetting"),
    ({"num_leaves": 1}, "num_leaves"), ({"validation_fraction": 1.0}, "validation_fraction"),
])
def test_bad_settings_are_named(setting: dict, message: str) -> None:
    with pytest.raises(GBDTError, match=message):
        OrthogonalBoostingRegressor(**setting).fit(np.ones((100, 2)), np.arange(100.0))


def test_non_numeric_and_wrongly_shaped_input() -> None:
    with pytest.raises(GBDTDataError, match="must be numbers"):
        OrthogonalBoostingRegressor(**SMALL).fit([["a", "b"]], [1.0])
    with pytest.raises(GBDTDataError, match="2-D"):
        OrthogonalBoostingRegressor(**SMALL).fit(np.ones(10), np.ones(10))
