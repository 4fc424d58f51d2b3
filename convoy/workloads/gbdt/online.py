"""Online learner weights: least squares with exponential forgetting over the learners' outputs.

The state is the forgetting-weighted Gram matrix ``A = sum_t beta^(age) H_t^T diag(h_t) H_t`` (``h``:
the loss's Hessian per row, 1 for the squared loss) and, for the squared loss, the moment
``b = sum_t beta^(age) H_t^T y_t``. A mini-batch of ``m`` rows decays both by ``beta^m`` and adds its
own terms; the squared loss then solves ``(A + ridge D) w = b`` exactly (recursive least squares in
batch form), the logistic loss takes one Newton step ``w += (A + ridge D)^-1 H^T (y - p)``
(recursive Newton, as in RLS for generalised linear models). Cost per batch: ``O(m K^2 + K^3)`` for
``K`` learners, whatever the number of rows seen before. The tree structures never change here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from convoy.workloads.gbdt.orthogonal import Loss, solve_weights


@dataclass
class OnlineWeights:
    """Forgetting-weighted sufficient statistics and the current weights (intercept first)."""

    gram: np.ndarray
    moment: np.ndarray
    weights: np.ndarray
    rows: float
    """Effective (forgetting-weighted) number of rows behind ``gram``."""
    forgetting: float
    """Per-row decay beta in (0, 1]; the memory is about ``1 / (1 - beta)`` rows."""
    ridge: float
    """Ridge penalty per effective row (the intercept is not penalised)."""

    @classmethod
    def start(cls, loss: Loss, outputs: np.ndarray, target: np.ndarray, weights: np.ndarray, forgetting: float,
              ridge: float, gram: np.ndarray | None = None) -> OnlineWeights:
        """Statistics of ``outputs`` (rows x learners) at ``weights``, scaled down to the forgetting memory;
        ``gram``: their Hessian-weighted Gram matrix if already known."""
        memory = np.inf if forgetting >= 1 else 1.0 / (1.0 - forgetting)
        scale = min(1.0, memory / len(target))
        if gram is None:
            gram = _weighted_gram(loss, outputs, target, weights)
        gram = scale * gram
        moment = scale * (outputs.T @ target)
        return cls(gram, moment, weights.copy(), scale * len(target), forgetting, ridge)

    def update(self, loss: Loss, outputs: np.ndarray, target: np.ndarray) -> np.ndarray:
        """Fold one mini-batch in and move the weights; returns the batch's (Hessian-weighted) Gram matrix."""
        decay = self.forgetting ** len(target)
        score = outputs @ self.weights
        batch_gram = _weighted_gram(loss, outputs, target, self.weights)
        self.gram = decay * self.gram + batch_gram
        self.moment = decay * self.moment + outputs.T @ target
        self.rows = decay * self.rows + len(target)
        if loss.name == "squared":
            self.weights = solve_weights(self.gram, self.moment, self.ridge * self.rows)
        else:
            step = solve_weights(self.gram, outputs.T @ loss.negative_gradient(target, score), self.ridge * self.rows)
            self.weights = self.weights + step
        return batch_gram

    def state(self) -> dict[str, object]:
        """JSON-ready copy (see io.py)."""
        return {"gram": self.gram.tolist(), "moment": self.moment.tolist(), "weights": self.weights.tolist(),
                "rows": self.rows, "forgetting": self.forgetting, "ridge": self.ridge}

    @classmethod
    def from_state(cls, state: dict[str, object]) -> OnlineWeights:
        """The inverse of ``state``; ValueError when the pieces do not fit together."""
        weights = np.asarray(state["weights"], dtype=np.float64)
        gram = np.asarray(state["gram"], dtype=np.float64)
        moment = np.asarray(state["moment"], dtype=np.float64)
        if weights.ndim != 1 or gram.shape != (len(weights), len(weights)) or moment.shape != weights.shape:
            raise ValueError(f"online state has {weights.size} weights, a gram of shape {gram.shape} and a moment of "
                             f"shape {moment.shape}")
        return cls(gram, moment, weights, float(state["rows"]), float(state["forgetting"]), float(state["ridge"]))


def _weighted_gram(loss: Loss, outputs: np.ndarray, target: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``H^T diag(hessian) H`` (plain ``H^T H`` for the squared loss, whose Hessian is 1), as ``S^T S`` with
    ``S = diag(sqrt(hessian)) H`` so that BLAS computes one triangle only."""
    if loss.name == "squared":
        return outputs.T @ outputs
    scaled = outputs * np.sqrt(loss.hessian(target, outputs @ weights))[:, None]
    return scaled.T @ scaled


class GrowthWindow:
    """Rows collected since a drift was detected, with the learners' outputs on them and those outputs'
    Gram matrix (accumulated batch by batch, so growing new learners needs no pass over all of them)."""

    def __init__(self) -> None:
        self.clear()

    @property
    def num_rows(self) -> int:
        return sum(len(target) for target in self._targets)

    def add(self, features: np.ndarray, target: np.ndarray, outputs: np.ndarray,
            gram: np.ndarray | None = None) -> None:
        """Keep a batch; ``gram``: ``outputs^T outputs`` if already computed."""
        self._features.append(features)
        self._targets.append(target)
        self._outputs.append(outputs)
        gram = outputs.T @ outputs if gram is None else gram
        self.gram = gram if self.gram is None else self.gram + gram

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(features, target, outputs) of all collected rows."""
        return np.concatenate(self._features), np.concatenate(self._targets), np.concatenate(self._outputs)

    def clear(self) -> None:
        self._features: list[np.ndarray] = []
        self._targets: list[np.ndarray] = []
        self._outputs: list[np.ndarray] = []
        self.gram: np.ndarray | None = None
