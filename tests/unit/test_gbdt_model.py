"""The scikit-learn style surface: shapes, labels, importances, settings, and accuracy on shipped data."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_breast_cancer, load_diabetes

from convoy.workloads.gbdt import OrthogonalBoostingClassifier, OrthogonalBoostingRegressor


def test_importances_point_at_the_features_that_matter() -> None:
    rng = np.random.default_rng(0)
    features = rng.uniform(size=(2000, 6))
    target = 8 * features[:, 0] + 4 * np.sin(6 * features[:, 3]) + rng.normal(0, 0.2, 2000)
    model = OrthogonalBoostingRegressor(n_learners=30, min_data_in_leaf=20).fit(features, target)
    importances = model.feature_importances_
    assert importances.shape == (6,) and abs(importances.sum() - 1) < 1e-12
    assert importances[[0, 3]].sum() > 0.95
    assert model.n_learners_ == 30 and model.weights_.shape == (31,) and model.n_features_in_ == 6
    assert model.predict(features[:5]).shape == (5,) and model.predict(features[0]).shape == (1,)


def test_regressor_beats_the_mean_on_diabetes() -> None:
    features, target = load_diabetes(return_X_y=True)
    model = OrthogonalBoostingRegressor(n_learners=50).fit(features[:350], target[:350])
    error = np.sqrt(np.mean((model.predict(features[350:]) - target[350:]) ** 2))
    assert error < 0.85 * np.std(target[350:])


def test_classifier_on_breast_cancer_keeps_string_labels() -> None:
    features, target = load_breast_cancer(return_X_y=True)
    labels = np.where(target == 1, "benign", "malignant")
    model = OrthogonalBoostingClassifier(n_learners=30, min_data_in_leaf=20).fit(features[:450], labels[:450])
    assert model.classes_.tolist() == ["benign", "malignant"]
    probabilities = model.predict_proba(features[450:])
    assert probabilities.shape == (119, 2) and np.allclose(probabilities.sum(axis=1), 1)
    assert np.mean(model.predict(features[450:]) == labels[450:]) > 0.9


def test_a_fixed_ridge_skips_the_validation_split() -> None:
    rng = np.random.default_rng(1)
    features = rng.uniform(size=(500, 3))
    model = OrthogonalBoostingRegressor(n_learners=10, ridge=0.01, min_data_in_leaf=20)
    model.fit(features, features.sum(axis=1))
    assert model.ridge_ == 0.01 and model.get_params()["ridge"] == 0.01
