"""Offline orthogonal boosting: each new tree fits only the part of the gradient that the trees so
far cannot express, and all tree weights are then refitted by ridge-regularised least squares.

Round k: the negative gradient ``g`` of the loss at the current scores is projected onto the
orthogonal complement of ``span(1, h_1, ..., h_k)`` (the learners' outputs on the training rows,
kept as an orthonormal basis ``Q``): ``r = g - Q Q^T g``. LightGBM grows tree ``k + 1`` on ``r``;
its outputs join the basis, and the weights ``w`` of ``f = H w`` are refitted (squared loss: ridge
least squares, exact every round; logistic loss: ridge-regularised Newton steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from convoy.workloads.gbdt.trees import TreeEnsemble, TreeParams

TargetHook = Callable[[np.ndarray, np.ndarray], None]
"""Called with (target handed to the next tree, outputs of the learners so far) before each tree."""


class Loss(Protocol):
    name: str

    def initial_score(self, target: np.ndarray) -> float: ...
    def negative_gradient(self, target: np.ndarray, score: np.ndarray) -> np.ndarray: ...
    def hessian(self, target: np.ndarray, score: np.ndarray) -> np.ndarray: ...
    def loss(self, target: np.ndarray, score: np.ndarray) -> np.ndarray: ...
    def transform(self, score: np.ndarray) -> np.ndarray: ...


class OrthogonalBasis:
    """The span of some prior columns (through their Gram matrix) plus orthonormal vectors added one at a time.

    The prior part projects with ``C (C^T v)``, ``C = prior V S^-1/2`` from the eigendecomposition
    ``prior^T prior = V S V^T`` (directions with a negligible eigenvalue dropped), without forming
    ``C``: two products with ``prior``, so a Gram matrix that was accumulated batch by batch is
    reused. Added vectors are Gram-Schmidt'ed against everything; each projection runs twice, which
    keeps the result orthogonal to rounding error.
    """

    def __init__(self, prior: np.ndarray, gram: np.ndarray | None = None, capacity: int = 8) -> None:
        gram = prior.T @ prior if gram is None else gram
        values, vectors = np.linalg.eigh(gram)
        keep = values > 1e-10 * max(float(values.max()), 1e-300)
        self.prior = prior
        self.factor = vectors[:, keep] / np.sqrt(values[keep])
        self.vectors = np.empty((prior.shape[0], max(capacity, 1)))
        self.size = 0

    def _project_once(self, vector: np.ndarray) -> np.ndarray:
        vector = vector - self.prior @ (self.factor @ (self.factor.T @ (self.prior.T @ vector)))
        basis = self.vectors[:, : self.size]
        return vector - basis @ (basis.T @ vector)

    def project_out(self, vector: np.ndarray) -> np.ndarray:
        """``vector`` minus its projection onto the span: the part no learner so far expresses."""
        return self._project_once(self._project_once(vector))

    def add(self, vector: np.ndarray, tolerance: float = 1e-9) -> bool:
        """Extend the span by ``vector``; False (and nothing added) when it is already in the span."""
        residual = self.project_out(vector)
        norm = float(np.linalg.norm(residual))
        if norm <= tolerance * max(float(np.linalg.norm(vector)), 1e-300):
            return False
        if self.size == self.vectors.shape[1]:
            self.vectors = np.concatenate([self.vectors, np.empty_like(self.vectors)], axis=1)
        self.vectors[:, self.size] = residual / norm
        self.size += 1
        return True


def penalty(num_weights: int, ridge: float) -> np.ndarray:
    """Ridge penalty matrix: ``ridge`` on every learner's weight, none on the intercept (column 0)."""
    diagonal = np.full(num_weights, ridge)
    diagonal[0] = 0.0
    return np.diag(diagonal)


def solve_weights(gram: np.ndarray, moment: np.ndarray, ridge: float) -> np.ndarray:
    """``(gram + ridge * D) w = moment`` with D the identity except for the intercept."""
    system = gram + penalty(len(moment), ridge)
    try:
        return np.linalg.solve(system, moment)
    except np.linalg.LinAlgError:
        return np.linalg.lstsq(system, moment, rcond=None)[0]


def newton_step(loss: Loss, outputs: np.ndarray, target: np.ndarray, weights: np.ndarray,
                ridge: float) -> np.ndarray:
    """One ridge-regularised Newton step on all weights (for the squared loss, the exact solution)."""
    score = outputs @ weights
    hessian = loss.hessian(target, score)
    gram = outputs.T @ (outputs * hessian[:, None])
    gradient = outputs.T @ loss.negative_gradient(target, score) - penalty(len(weights), ridge) @ weights
    return weights + solve_weights(gram, gradient, ridge)


def boost(features: np.ndarray, target: np.ndarray, loss: Loss, num_learners: int, tree_params: TreeParams,
          ridge: float, ensemble: TreeEnsemble | None = None, weights: np.ndarray | None = None,
          prior: tuple[np.ndarray, np.ndarray] | None = None, refit_every: int = 10,
          on_target: TargetHook | None = None) -> tuple[TreeEnsemble, np.ndarray, np.ndarray, np.ndarray | None]:
    """Grow up to ``num_learners`` orthogonal trees on (features, target), as a new segment of ``ensemble``
    (default: a new ensemble) whose current ``weights`` (intercept first) are the starting point. Returns the
    ensemble, the weights, the learners' outputs on the rows (intercept column first) and, for the squared
    loss, the Gram matrix of those outputs (None for the logistic loss). ``prior``: the
    existing learners' outputs on the rows (intercept column first) and their Gram matrix, if known.

    ``ridge`` is per row (the penalty is ``ridge * rows``). Squared loss: the weights are the exact ridge
    solution every round (the Gram matrix grows by one row and column per tree). Logistic loss: a Newton
    step on the intercept and the new weight every round, on all weights every ``refit_every`` rounds.
    Stops early when a tree finds no split or adds nothing to the span.
    """
    num_rows = len(target)
    scaled_ridge = ridge * num_rows
    if ensemble is None:
        ensemble = TreeEnsemble(features.shape[1])
        weights = np.array([loss.initial_score(target)])
    if prior is None:
        columns = np.column_stack([np.ones(num_rows), ensemble.outputs(features)])
        prior = columns, columns.T @ columns
    prior, prior_gram = prior
    if weights is None or len(weights) != prior.shape[1]:
        raise ValueError("weights must hold the intercept and one weight per tree of the ensemble")
    grower = ensemble.grower(features, tree_params)
    outputs = np.empty((num_rows, prior.shape[1] + num_learners))
    outputs[:, : prior.shape[1]] = prior
    basis = OrthogonalBasis(prior, prior_gram, capacity=num_learners)
    gram = np.zeros((outputs.shape[1], outputs.shape[1]))
    moment = np.zeros(outputs.shape[1])
    squared = loss.name == "squared"
    if squared:
        gram[: prior.shape[1], : prior.shape[1]] = prior_gram
        moment[: prior.shape[1]] = prior.T @ target
    score = prior @ weights
    for _ in range(num_learners):
        count = len(weights)
        projected = basis.project_out(loss.negative_gradient(target, score))
        if on_target is not None:
            on_target(projected, outputs[:, :count])
        tree_output = grower.grow(projected, loss.hessian(target, score))
        if tree_output is None:
            break
        basis.add(tree_output)
        outputs[:, count] = tree_output
        current = outputs[:, : count + 1]
        weights = _with_new_tree(loss, current, target, weights, scaled_ridge, refit_every, (gram, moment))
        score = current @ weights
    grower.finish()
    count = len(weights)
    return ensemble, weights, outputs[:, :count], gram[:count, :count] if squared else None

def _with_new_tree(loss: Loss, current: np.ndarray, target: np.ndarray, weights: np.ndarray, scaled_ridge: float,
                   refit_every: int, moments: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The weights once the last column of ``current`` (a new tree's outputs, its weight starting at 0) joined.
    Squared loss: the exact ridge solution, the Gram matrix and the moments (``moments``) grown by the new tree;
    logistic: a Newton step on all weights every ``refit_every`` trees, else on the intercept and the new one."""
    count = current.shape[1] - 1
    tree_output = current[:, count]
    weights = np.append(weights, 0.0)
    if loss.name == "squared":
        gram, moment = moments
        gram[count, : count + 1] = gram[: count + 1, count] = current.T @ tree_output
        moment[count] = tree_output @ target
        return solve_weights(gram[: count + 1, : count + 1], moment[: count + 1], scaled_ridge)
    if count % refit_every == 0:
        return newton_step(loss, current, target, weights, scaled_ridge)
    weights[[0, count]] = _pair_step(loss, current, target, weights, [0, count], scaled_ridge)
    return weights



def fit_weights(loss: Loss, outputs: np.ndarray, target: np.ndarray, ridge: float,
                start: np.ndarray | None = None, max_steps: int = 8) -> np.ndarray:
    """Ridge-regularised weights of the columns of ``outputs`` (``ridge`` per row): exact for the squared
    loss, Newton's method from ``start`` for the logistic loss."""
    scaled_ridge = ridge * len(target)
    if loss.name == "squared":
        return solve_weights(outputs.T @ outputs, outputs.T @ target, scaled_ridge)
    weights = np.zeros(outputs.shape[1]) if start is None else start.copy()
    if start is None:
        weights[0] = loss.initial_score(target)
    for _ in range(max_steps):
        updated = newton_step(loss, outputs, target, weights, scaled_ridge)
        converged = np.max(np.abs(updated - weights)) < 1e-6 * (1 + np.max(np.abs(weights)))
        weights = updated
        if converged:
            break
    return weights


def select_ridge(loss: Loss, train: tuple[np.ndarray, np.ndarray], validation: tuple[np.ndarray, np.ndarray],
                 grid: tuple[float, ...], start: np.ndarray) -> float:
    """The ridge (per row) of ``grid`` whose weights, fitted on ``train``, give the lowest validation loss
    (each fit starts from the previous one's weights)."""
    best_ridge, best_loss = grid[0], np.inf
    weights = start
    for ridge in grid:
        weights = fit_weights(loss, *train, ridge, start=weights)
        validation_loss = float(np.mean(loss.loss(validation[1], validation[0] @ weights)))
        if validation_loss < best_loss:
            best_ridge, best_loss = ridge, validation_loss
    return best_ridge


def _pair_step(loss: Loss, outputs: np.ndarray, target: np.ndarray, weights: np.ndarray, pair: list[int],
               ridge: float) -> np.ndarray:
    """Newton step on the intercept and the newest weight only, the other weights held."""
    score = outputs @ weights
    columns = outputs[:, pair]
    hessian = loss.hessian(target, score)
    gram = columns.T @ (columns * hessian[:, None])
    gradient = columns.T @ loss.negative_gradient(target, score) - penalty(2, ridge) @ weights[pair]
    return weights[pair] + solve_weights(gram, gradient, ridge)
