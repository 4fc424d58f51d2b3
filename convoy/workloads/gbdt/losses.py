"""The two losses: squared error (regression) and logistic (binary classification), on raw scores."""

from __future__ import annotations

import numpy as np


class SquaredLoss:
    """``(y - f)^2 / 2``: the raw score is the prediction."""

    name = "squared"

    def initial_score(self, target: np.ndarray) -> float:
        return float(np.mean(target))

    def negative_gradient(self, target: np.ndarray, score: np.ndarray) -> np.ndarray:
        return target - score

    def hessian(self, target: np.ndarray, score: np.ndarray) -> np.ndarray:
        return np.ones_like(score)

    def loss(self, target: np.ndarray, score: np.ndarray) -> np.ndarray:
        """Per-row loss (what the drift detector watches)."""
        return 0.5 * (target - score) ** 2

    def transform(self, score: np.ndarray) -> np.ndarray:
        return score


class LogisticLoss:
    """``-y log p - (1 - y) log(1 - p)`` with ``p = sigmoid(f)``, targets in {0, 1}."""

    name = "logistic"

    def initial_score(self, target: np.ndarray) -> float:
        mean = float(np.clip(np.mean(target), 1e-6, 1 - 1e-6))
        return float(np.log(mean / (1 - mean)))

    def negative_gradient(self, target: np.ndarray, score: np.ndarray) -> np.ndarray:
        return target - sigmoid(score)

    def hessian(self, target: np.ndarray, score: np.ndarray) -> np.ndarray:
        probability = sigmoid(score)
        return np.maximum(probability * (1 - probability), 1e-6)

    def loss(self, target: np.ndarray, score: np.ndarray) -> np.ndarray:
        return np.logaddexp(0.0, score) - target * score

    def transform(self, score: np.ndarray) -> np.ndarray:
        return sigmoid(score)


def sigmoid(score: np.ndarray) -> np.ndarray:
    """Overflow-free logistic function."""
    return np.exp(-np.logaddexp(0.0, -score))


LOSSES = {"squared": SquaredLoss(), "logistic": LogisticLoss()}
