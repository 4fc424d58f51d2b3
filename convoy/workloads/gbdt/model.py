"""The scikit-learn style estimators: ``OrthogonalBoostingRegressor`` and ``OrthogonalBoostingClassifier``.

``fit`` grows orthogonal trees offline (orthogonal.py) on all but a validation share of the rows,
picks the ridge penalty on that share, and refits the weights on all rows. ``partial_fit`` then
takes a stream of mini-batches: the weights follow it by least squares with forgetting
(online.py); a Page-Hinkley test on the batch loss (drift.py) decides when weights are not enough,
and then ``learners_per_drift`` new orthogonal trees are grown on the next ``growth_rows`` rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from convoy.workloads.gbdt.data import binary_labels, check_features, check_labels, check_target
from convoy.workloads.gbdt.drift import PageHinkley
from convoy.workloads.gbdt.errors import GBDTError, GBDTModelError
from convoy.workloads.gbdt.io import read_document, write_document
from convoy.workloads.gbdt.losses import LOSSES
from convoy.workloads.gbdt.online import GrowthWindow, OnlineWeights
from convoy.workloads.gbdt.orthogonal import boost, fit_weights, select_ridge
from convoy.workloads.gbdt.threads import single_blas_thread
from convoy.workloads.gbdt.trees import TreeEnsemble, TreeParams

RIDGE_GRID = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
"""Ridge penalties per row that ``ridge="auto"`` chooses from on the validation rows."""
GROWTH_RIDGE = 1e-4
"""Ridge per row while trees are grown (the final one is chosen afterwards)."""


class OrthogonalBoosting:
    """Shared machinery of the regressor and the classifier; use one of those."""

    loss_name = ""

    def __init__(self, n_learners: int = 200, num_leaves: int = 4, min_data_in_leaf: int = 50,
                 lambda_l2: float | None = None, max_bin: int = 255, feature_fraction: float = 1.0,
                 ridge: float | str = "auto", validation_fraction: float = 0.15, forgetting: float = 0.9998,
                 growth_rows: int = 3000, learners_per_drift: int = 5, drift_delta: float = 0.1,
                 drift_threshold: float = 0.5, num_threads: int = 2, random_state: int = 0) -> None:
        self.n_learners = n_learners
        self.num_leaves = num_leaves
        self.min_data_in_leaf = min_data_in_leaf
        self.lambda_l2 = lambda_l2
        self.max_bin = max_bin
        self.feature_fraction = feature_fraction
        self.ridge = ridge
        self.validation_fraction = validation_fraction
        self.forgetting = forgetting
        self.growth_rows = growth_rows
        self.learners_per_drift = learners_per_drift
        self.drift_delta = drift_delta
        self.drift_threshold = drift_threshold
        self.num_threads = num_threads
        self.random_state = random_state
        self.trees_: TreeEnsemble | None = None

    # -- settings -------------------------------------------------------------------------------------------

    def get_params(self) -> dict[str, Any]:
        """The constructor's arguments (what ``save`` stores and ``load`` passes back)."""
        names = ("n_learners", "num_leaves", "min_data_in_leaf", "lambda_l2", "max_bin", "feature_fraction", "ridge",
                 "validation_fraction", "forgetting", "growth_rows", "learners_per_drift", "drift_delta",
                 "drift_threshold", "num_threads", "random_state")
        return {name: getattr(self, name) for name in names}

    def tree_params(self) -> TreeParams:
        lambda_l2 = self.lambda_l2
        if lambda_l2 is None:  # the same penalty relative to a leaf's Hessian sum: logistic Hessians are <= 1/4
            lambda_l2 = 100.0 if self.loss_name == "squared" else 25.0
        params = TreeParams(num_leaves=self.num_leaves, min_data_in_leaf=self.min_data_in_leaf,
                            lambda_l2=lambda_l2, max_bin=self.max_bin, feature_fraction=self.feature_fraction,
                            num_threads=self.num_threads, seed=self.random_state)
        params.validate()
        return params

    def _validate(self) -> None:
        if self.n_learners < 1:
            raise GBDTError(f"n_learners must be >= 1 (got {self.n_learners})")
        if not (isinstance(self.ridge, str) and self.ridge == "auto") and not (
                isinstance(self.ridge, (int, float)) and self.ridge >= 0):
            raise GBDTError(f"ridge must be 'auto' or a number >= 0 (got {self.ridge!r})")
        if not 0 <= self.validation_fraction < 1:
            raise GBDTError(f"validation_fraction must be in [0, 1) (got {self.validation_fraction})")
        if not 0 < self.forgetting <= 1:
            raise GBDTError(f"forgetting must be in (0, 1] (got {self.forgetting})")
        if self.growth_rows < 2 * self.min_data_in_leaf or self.learners_per_drift < 0:
            raise GBDTError(f"growth_rows must be >= 2 * min_data_in_leaf and learners_per_drift >= 0 "
                            f"(got {self.growth_rows}, {self.learners_per_drift})")
        self.tree_params()

    # -- offline --------------------------------------------------------------------------------------------

    @single_blas_thread
    def fit(self, X: Any, y: Any) -> OrthogonalBoosting:
        """Grow ``n_learners`` orthogonal trees on (X, y) and set up the online state."""
        self._validate()
        features = check_features(X)
        target = self._target(y, len(features), fitting=True)
        loss = LOSSES[self.loss_name]
        order = np.random.default_rng(self.random_state).permutation(len(target))
        held_out = int(len(target) * self.validation_fraction) if self.ridge == "auto" else 0
        if held_out and len(target) - held_out < 2 * self.min_data_in_leaf:
            held_out = 0
        grow_rows, validation_rows = np.sort(order[held_out:]), np.sort(order[:held_out])
        trees, weights, _, _ = boost(features[grow_rows], target[grow_rows], loss, self.n_learners, self.tree_params(),
                                  GROWTH_RIDGE if self.ridge == "auto" else float(self.ridge))
        outputs = _with_intercept(trees.outputs(features))
        if held_out:
            ridge = select_ridge(loss, (outputs[grow_rows], target[grow_rows]),
                                 (outputs[validation_rows], target[validation_rows]), RIDGE_GRID, weights)
        else:
            ridge = GROWTH_RIDGE if self.ridge == "auto" else float(self.ridge)
        weights = fit_weights(loss, outputs, target, ridge, start=weights)
        reference_rows = validation_rows if held_out else grow_rows
        self.trees_ = trees
        self.ridge_ = ridge
        self.n_features_in_ = features.shape[1]
        self.reference_loss_ = max(float(np.mean(loss.loss(target[reference_rows], outputs[reference_rows] @ weights))),
                                   1e-12)
        self.online_ = OnlineWeights.start(loss, outputs, target, weights, self.forgetting, ridge)
        self.detector_ = PageHinkley(self.drift_delta, self.drift_threshold)
        self.window_ = GrowthWindow()
        self.collecting_ = False
        self.drifts_ = 0
        self.rows_seen_ = 0
        return self

    # -- online ---------------------------------------------------------------------------------------------

    @single_blas_thread
    def partial_fit(self, X: Any, y: Any) -> OrthogonalBoosting:
        """Learn from one mini-batch of a stream: move the weights; on drift, grow new learners."""
        self._check_fitted()
        features = check_features(X, self.n_features_in_)
        target = self._target(y, len(features), fitting=False)
        loss = LOSSES[self.loss_name]
        outputs = _with_intercept(self.trees_.outputs(features))
        batch_loss = float(np.mean(loss.loss(target, outputs @ self.online_.weights)))
        batch_gram = self.online_.update(loss, outputs, target)
        self.rows_seen_ += len(target)
        if not self.collecting_ and self.learners_per_drift and self.detector_.update(
                batch_loss / self.reference_loss_):
            self.drifts_ += 1
            self.collecting_ = True
        if self.collecting_:
            self.window_.add(features, target, outputs, batch_gram if self.loss_name == "squared" else None)
            if self.window_.num_rows >= self.growth_rows:
                features, target, outputs = self.window_.arrays()
                self._grow(features, target, (outputs, self.window_.gram), self.learners_per_drift)
                self.window_.clear()
                self.collecting_ = False
        return self

    @single_blas_thread
    def grow(self, X: Any, y: Any, count: int | None = None) -> int:
        """Add up to ``count`` (default ``learners_per_drift``) orthogonal trees fitted on (X, y), refit the
        weights there and restart the online statistics from those rows; returns how many were added."""
        self._check_fitted()
        features = check_features(X, self.n_features_in_)
        target = self._target(y, len(features), fitting=False)
        outputs = _with_intercept(self.trees_.outputs(features))
        return self._grow(features, target, (outputs, outputs.T @ outputs),
                          self.learners_per_drift if count is None else count)

    def _grow(self, features: np.ndarray, target: np.ndarray, prior: tuple[np.ndarray, np.ndarray],
              count: int) -> int:
        loss = LOSSES[self.loss_name]
        before = self.trees_.num_trees
        _, weights, outputs, gram = boost(features, target, loss, count, self.tree_params(), self.ridge_,
                                          self.trees_, self.online_.weights, prior=prior)
        added = self.trees_.num_trees - before
        if added:
            self.online_ = OnlineWeights.start(loss, outputs, target, weights, self.forgetting, self.ridge_, gram)
        return added

    # -- predicting -----------------------------------------------------------------------------------------

    @single_blas_thread
    def decision_function(self, X: Any) -> np.ndarray:
        """Raw scores ``w_0 + sum_k w_k h_k(x)`` (the prediction itself for the regressor, log-odds for the
        classifier)."""
        self._check_fitted()
        features = check_features(X, self.n_features_in_)
        return _with_intercept(self.trees_.outputs(features)) @ self.online_.weights

    @property
    def n_learners_(self) -> int:
        """Trees in the model now (offline ones plus those grown on drift)."""
        self._check_fitted()
        return self.trees_.num_trees

    @property
    def weights_(self) -> np.ndarray:
        """Current learner weights, intercept first."""
        self._check_fitted()
        return self.online_.weights

    @property
    def feature_importances_(self) -> np.ndarray:
        """Share of each feature in the split gain of all trees, each tree counted by ``|weight|``; sums to 1."""
        self._check_fitted()
        gains = np.abs(self.online_.weights[1:]) @ self.trees_.split_gains()
        total = float(gains.sum())
        return gains / total if total > 0 else gains

    def save(self, path: str | Path) -> None:
        """Write the model, online state included, as one JSON file (its format and fields: io.py)."""
        write_document(self.to_dict(), Path(path))

    @staticmethod
    def load(path: str | Path) -> OrthogonalBoosting:
        """Read a model written by ``save`` (a regressor or a classifier, whichever was saved)."""
        document = read_document(Path(path))
        try:
            return OrthogonalBoosting.from_dict(document)
        except (KeyError, TypeError, ValueError) as exc:
            raise GBDTModelError(f"{str(path)!r} is a damaged convoy gbdt model ({type(exc).__name__}: {exc})") from exc

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready description of the fitted model (fields: io.py's docstring)."""
        self._check_fitted()
        classes = getattr(self, "classes_", None)
        if self.window_.num_rows:
            features, target, _ = self.window_.arrays()
            window = {"features": features.tolist(), "target": target.tolist()}
        else:
            window = {"features": [], "target": []}
        return {
            "estimator": type(self).__name__, "params": self.get_params(),
            "classes": None if classes is None else classes.tolist(), "num_features": self.n_features_in_,
            "ridge": self.ridge_, "reference_loss": self.reference_loss_, "rows_seen": self.rows_seen_,
            "drifts": self.drifts_, "collecting": self.collecting_, "online": self.online_.state(),
            "drift": self.detector_.state(), "window": window, "trees": self.trees_.to_strings(),
        }

    @staticmethod
    def from_dict(document: dict[str, Any]) -> OrthogonalBoosting:
        """The model ``to_dict`` described; KeyError, TypeError or ValueError where the document is damaged."""
        estimators = {cls.__name__: cls for cls in (OrthogonalBoostingRegressor, OrthogonalBoostingClassifier)}
        if document["estimator"] not in estimators:
            raise ValueError(f"unknown estimator {document['estimator']!r}")
        model = estimators[document["estimator"]](**document["params"])
        num_features = int(document["num_features"])
        model.trees_ = TreeEnsemble.from_strings(num_features, list(document["trees"]))
        model.online_ = OnlineWeights.from_state(document["online"])
        if len(model.online_.weights) != model.trees_.num_trees + 1:
            raise ValueError(f"{len(model.online_.weights)} weights for {model.trees_.num_trees} trees")
        if document["classes"] is not None:
            model.classes_ = np.asarray(document["classes"])
        model.n_features_in_ = num_features
        model.ridge_ = float(document["ridge"])
        model.reference_loss_ = float(document["reference_loss"])
        if not math.isfinite(model.reference_loss_) or model.reference_loss_ <= 0:
            raise ValueError("reference_loss must be a positive number")
        model.rows_seen_ = int(document["rows_seen"])
        model.drifts_ = int(document["drifts"])
        model.collecting_ = bool(document["collecting"])
        model.detector_ = PageHinkley(**document["drift"])
        model.window_ = GrowthWindow()
        window = document["window"]
        if window["target"]:
            features = np.asarray(window["features"], dtype=np.float64).reshape(-1, num_features)
            outputs = np.column_stack([np.ones(len(features)), model.trees_.outputs(features)])
            model.window_.add(features, np.asarray(window["target"], dtype=np.float64), outputs)
        return model

    # -- helpers --------------------------------------------------------------------------------------------

    def _check_fitted(self) -> None:
        if self.trees_ is None:
            raise GBDTModelError(f"this {type(self).__name__} is not fitted yet; call fit(X, y) (or load a model) "
                                 "before partial_fit, predict or save")

    def _target(self, y: Any, num_rows: int, fitting: bool) -> np.ndarray:
        """The target as the loss sees it (numbers for the regressor, 0/1 for the classifier)."""
        return check_target(y, num_rows)


class OrthogonalBoostingRegressor(OrthogonalBoosting):
    """Squared-loss regression with orthogonal trees and online weights."""

    loss_name = "squared"

    def predict(self, X: Any) -> np.ndarray:
        """Predicted targets."""
        return self.decision_function(X)


class OrthogonalBoostingClassifier(OrthogonalBoosting):
    """Binary classification (logistic loss) with orthogonal trees and online weights."""

    loss_name = "logistic"
    classes_: np.ndarray | None = None

    def _target(self, y: Any, num_rows: int, fitting: bool) -> np.ndarray:
        labels, classes = binary_labels(check_labels(y, num_rows), None if fitting else self.classes_)
        self.classes_ = classes
        return labels

    def predict_proba(self, X: Any) -> np.ndarray:
        """(rows x 2) probabilities of ``classes_[0]`` and ``classes_[1]``."""
        positive = LOSSES["logistic"].transform(self.decision_function(X))
        return np.column_stack([1 - positive, positive])

    def predict(self, X: Any) -> np.ndarray:
        """The more probable class of each row."""
        return self.classes_[(self.decision_function(X) > 0).astype(int)]


def _with_intercept(outputs: np.ndarray) -> np.ndarray:
    return np.column_stack([np.ones(len(outputs)), outputs])
