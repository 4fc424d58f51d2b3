"""Offline orthogonal boosting: each tree's target is orthogonal to every earlier learner's outputs."""

from __future__ import annotations

import numpy as np
import pytest

from convoy.workloads.gbdt.losses import LOSSES
from convoy.workloads.gbdt.orthogonal import OrthogonalBasis, boost, fit_weights, solve_weights
from convoy.workloads.gbdt.trees import TreeParams

TREES = TreeParams(num_leaves=4, min_data_in_leaf=20, lambda_l2=1.0)


def friedman(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.uniform(size=(rows, 6))
    x = features.T
    target = 10 * np.sin(np.pi * x[0] * x[1]) + 20 * (x[2] - 0.5) ** 2 + 10 * x[3] + 5 * x[4]
    return features, target + rng.normal(0, 1.0, rows)


def largest_cosine(target: np.ndarray, outputs: np.ndarray) -> float:
    """Largest |cos| between ``target`` and a column of ``outputs``."""
    norms = np.linalg.norm(outputs, axis=0) * np.linalg.norm(target)
    return float(np.max(np.abs(outputs.T @ target) / norms))


@pytest.mark.parametrize("loss_name", ["squared", "logistic"])
def test_each_new_target_is_orthogonal_to_all_existing_learner_outputs(loss_name: str) -> None:
    features, target = friedman(1500, seed=0)
    if loss_name == "logistic":
        target = (target > np.median(target)).astype(np.float64)
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    ensemble, weights, outputs, _ = boost(features, target, LOSSES[loss_name], 25, TREES, 1e-4,
                                          on_target=lambda handed, existing: seen.append((handed, existing.copy())))
    assert ensemble.num_trees == 25 and len(weights) == 26 and outputs.shape == (1500, 26)
    assert len(seen) == 25
    for handed, existing in seen[1:]:
        assert np.linalg.norm(handed) > 1e-6  # something is left to fit ...
        assert largest_cosine(handed, existing) < 1e-9  # ... and none of it is in the span of the learners so far


def test_learners_grown_on_new_rows_are_orthogonal_there_too() -> None:
    features, target = friedman(1500, seed=1)
    ensemble, weights, _, _ = boost(features, target, LOSSES["squared"], 20, TREES, 1e-4)
    window, window_target = friedman(800, seed=2)
    window_target = window_target - 8 * window[:, 5]  # a drift: feature 5 starts to matter
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    ensemble, weights, outputs, gram = boost(window, window_target, LOSSES["squared"], 5, TREES, 1e-4, ensemble,
                                             weights, on_target=lambda t, o: seen.append((t, o.copy())))
    assert ensemble.num_trees == 25 and len(ensemble.segments) == 2
    assert [existing.shape[1] for _, existing in seen] == [21, 22, 23, 24, 25]
    assert all(largest_cosine(handed, existing) < 1e-9 for handed, existing in seen)
    np.testing.assert_allclose(gram, outputs.T @ outputs, rtol=1e-9, atol=1e-6)
    np.testing.assert_allclose(outputs[:, 1:], ensemble.outputs(window), rtol=0, atol=1e-12)


def test_weights_are_the_ridge_least_squares_solution() -> None:
    features, target = friedman(1000, seed=3)
    _, weights, outputs, _ = boost(features, target, LOSSES["squared"], 15, TREES, 1e-3)
    penalty = np.eye(16) * 1e-3 * 1000
    penalty[0, 0] = 0
    np.testing.assert_allclose(weights, np.linalg.solve(outputs.T @ outputs + penalty, outputs.T @ target),
                               rtol=1e-7)
    gradient = outputs.T @ (target - outputs @ weights) - penalty @ weights
    assert np.max(np.abs(gradient)) < 1e-6 * np.max(np.abs(outputs.T @ target))


def test_logistic_weights_reach_the_regularised_optimum() -> None:
    features, target = friedman(1000, seed=4)
    labels = (target > np.median(target)).astype(np.float64)
    _, weights, outputs, _ = boost(features, labels, LOSSES["logistic"], 10, TREES, 1e-3)
    weights = fit_weights(LOSSES["logistic"], outputs, labels, 1e-3, start=weights, max_steps=20)
    probability = 1 / (1 + np.exp(-(outputs @ weights)))
    penalty = np.full(11, 1e-3 * 1000)
    penalty[0] = 0
    assert np.max(np.abs(outputs.T @ (labels - probability) - penalty * weights)) < 1e-6


def test_basis_with_a_rank_deficient_prior_still_projects_exactly() -> None:
    rng = np.random.default_rng(5)
    prior = rng.normal(size=(300, 4))
    prior = np.column_stack([prior, prior[:, 0] + prior[:, 1]])  # five columns spanning four dimensions
    basis = OrthogonalBasis(prior, capacity=2)
    assert basis.factor.shape[1] == 4
    assert basis.add(rng.normal(size=300)) and not basis.add(prior[:, 2] * 3.0)
    residual = basis.project_out(rng.normal(size=300))
    assert largest_cosine(residual, np.column_stack([prior, basis.vectors[:, : basis.size]])) < 1e-12


def test_solve_weights_does_not_penalise_the_intercept() -> None:
    gram, moment = np.diag([4.0, 4.0]), np.array([8.0, 8.0])
    np.testing.assert_allclose(solve_weights(gram, moment, 4.0), [2.0, 1.0])
