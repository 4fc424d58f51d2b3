"""The histogram tree engine: LightGBM grows one tree per call on a target that convoy chooses.

convoy decides what each tree fits (the projected gradient) and how much each tree counts (its
weight); LightGBM only finds the splits, with its histogram algorithm, and sets leaf values to
``sum(target) / (sum(hessian) + lambda_l2)``. The ensemble keeps those leaf values in a table so
that turning rows into the matrix of per-tree outputs is one ``pred_leaf`` call per segment plus a
lookup. A segment is one LightGBM booster: the offline trees are the first, each drift-triggered
growth adds one (grown on its own rows, so no booster is retrained or merged).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from convoy.workloads.gbdt.errors import GBDTError
from convoy.workloads.gbdt.threads import lightgbm_module


@dataclass(frozen=True)
class TreeParams:
    """How each base learner is grown (LightGBM's names where they are LightGBM's settings)."""

    num_leaves: int = 15
    """Leaves per tree (leaf-wise growth)."""
    max_depth: int = -1
    """Depth limit (-1: none beyond num_leaves)."""
    min_data_in_leaf: int = 20
    """Fewest training rows a leaf may hold."""
    lambda_l2: float = 1.0
    """L2 penalty on leaf values: shrinks small leaves towards 0."""
    max_bin: int = 255
    """Histogram bins per feature."""
    feature_fraction: float = 1.0
    """Share of the features each tree may split on."""
    bagging_fraction: float = 1.0
    """Share of the rows each tree is grown on (drawn anew per tree)."""
    num_threads: int = 2
    """Threads LightGBM uses to build histograms."""
    seed: int = 0
    """Seed of LightGBM's sampling (feature_fraction, bagging_fraction)."""

    def validate(self) -> None:
        """Raise ``GBDTError`` naming the first setting out of range."""
        if self.num_leaves < 2:
            raise GBDTError(f"num_leaves must be >= 2 (got {self.num_leaves})")
        if self.min_data_in_leaf < 1:
            raise GBDTError(f"min_data_in_leaf must be >= 1 (got {self.min_data_in_leaf})")
        if self.lambda_l2 < 0:
            raise GBDTError(f"lambda_l2 must be >= 0 (got {self.lambda_l2})")
        for name in ("feature_fraction", "bagging_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise GBDTError(f"{name} must be in (0, 1] (got {getattr(self, name)})")
        if self.num_threads < 1 or self.max_bin < 2:
            raise GBDTError(f"num_threads must be >= 1 and max_bin >= 2 (got {self.num_threads}, {self.max_bin})")

    def lightgbm(self) -> dict[str, Any]:
        """LightGBM parameters for one tree per boosting call (gradients come from convoy: objective "none");
        learning_rate 1 since convoy weights the trees itself."""
        params = asdict(self)
        params.update(objective="none", learning_rate=1.0, verbose=-1, boost_from_average=False,
                      feature_fraction_seed=self.seed, bagging_seed=self.seed,
                      bagging_freq=int(self.bagging_fraction < 1), deterministic=True, force_row_wise=True,
                      min_sum_hessian_in_leaf=1e-6)
        return params


def _rows(features: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(features, dtype=np.float64)


class TreeEnsemble:
    """The tree structures (LightGBM boosters, one per segment) and a (trees x leaves) table of leaf values."""

    def __init__(self, num_features: int) -> None:
        self.num_features = num_features
        self.segments: list[Any] = []
        self.segment_starts: list[int] = []
        self.leaf_values = np.zeros((0, 1))

    @property
    def num_trees(self) -> int:
        return self.leaf_values.shape[0]

    def outputs(self, features: np.ndarray, start: int = 0) -> np.ndarray:
        """(rows x trees) matrix: column k is tree ``start + k``'s output on each row."""
        rows = _rows(features)
        columns = [np.zeros((len(rows), 0))]
        ends = [*self.segment_starts[1:], self.num_trees][: len(self.segments)]
        for booster, first, end in zip(self.segments, self.segment_starts, ends, strict=True):
            if end <= start:
                continue
            begin = max(start, first)
            leaves = booster.predict(rows, pred_leaf=True, start_iteration=begin - first, num_iteration=end - begin)
            leaves = np.asarray(leaves, dtype=np.int64).reshape(len(rows), end - begin)
            columns.append(self.leaf_values[np.arange(begin, end)[None, :], leaves])
        return np.concatenate(columns, axis=1)

    def grower(self, features: np.ndarray, params: TreeParams) -> TreeGrower:
        """Bin ``features`` once, then grow trees on them one call at a time, as a new segment."""
        return TreeGrower(self, features, params)

    def split_gains(self) -> np.ndarray:
        """(trees x features) total split gain of each tree on each feature."""
        gains = np.zeros((self.num_trees, self.num_features))
        for booster, first in zip(self.segments, self.segment_starts, strict=True):
            for offset, tree in enumerate(booster.dump_model()["tree_info"]):
                stack = [tree["tree_structure"]]
                while stack:
                    node = stack.pop()
                    if "split_feature" in node:
                        gains[first + offset, node["split_feature"]] += node["split_gain"]
                        stack.extend((node["left_child"], node["right_child"]))
        return gains

    def to_strings(self) -> list[str]:
        """Each segment in LightGBM's text model format."""
        return [booster.model_to_string() for booster in self.segments]

    @classmethod
    def from_strings(cls, num_features: int, texts: list[str]) -> TreeEnsemble:
        """The inverse of ``to_strings``."""
        lgb = lightgbm_module()

        ensemble = cls(num_features)
        for text in texts:
            booster = lgb.Booster(model_str=text)
            if booster.num_feature() != num_features:
                raise ValueError(f"a tree segment has {booster.num_feature()} features, the model {num_features}")
            ensemble._add_trees(booster, 0)
        return ensemble

    def _add_trees(self, booster: Any, first_tree: int) -> None:
        """Record ``booster``'s trees from ``first_tree`` on (a new segment when ``first_tree`` is 0)."""
        if first_tree == 0:
            self.segments.append(booster)
            self.segment_starts.append(self.num_trees)
        else:
            self.segments[-1] = booster
        trees = booster.dump_model(start_iteration=first_tree)["tree_info"]
        rows = [_leaf_values(tree["tree_structure"], tree["num_leaves"]) for tree in trees]
        width = max([self.leaf_values.shape[1], *(len(row) for row in rows)])
        table = np.zeros((self.num_trees + len(rows), width))
        table[: self.num_trees, : self.leaf_values.shape[1]] = self.leaf_values
        for offset, row in enumerate(rows):
            table[self.num_trees + offset, : len(row)] = row
        self.leaf_values = table


class TreeGrower:
    """Grows a new segment of a ``TreeEnsemble`` on fixed, pre-binned rows; each call fits a target given now."""

    def __init__(self, ensemble: TreeEnsemble, features: np.ndarray, params: TreeParams) -> None:
        lgb = lightgbm_module()

        self.ensemble = ensemble
        self.features = _rows(features)
        self.params = params
        self.trees = 0
        self._target = np.zeros(len(features))
        self._hessian = np.ones(len(features))
        dataset = lgb.Dataset(self.features, free_raw_data=False, params={"max_bin": params.max_bin, "verbose": -1})
        self._booster = lgb.Booster(params=params.lightgbm(), train_set=dataset)

    def _objective(self, predictions: np.ndarray, dataset: Any) -> tuple[np.ndarray, np.ndarray]:
        return -self._target, self._hessian

    def grow(self, target: np.ndarray, hessian: np.ndarray | None = None) -> np.ndarray | None:
        """Fit one tree to ``target`` (leaf value: sum of target / (sum of hessian + lambda_l2)); its outputs on
        the rows, or None (and no tree kept) when no split improves the fit."""
        self._target = np.asarray(target, dtype=np.float64)
        self._hessian = np.ones(len(target)) if hessian is None else np.asarray(hessian, dtype=np.float64)
        self._booster.update(fobj=self._objective)
        if self._booster.num_trees() == self.trees:
            return None
        tree = self._booster.dump_model(start_iteration=self.trees)["tree_info"][0]
        if tree["num_leaves"] < 2:
            self._booster.rollback_one_iter()
            return None
        self.ensemble._add_trees(self._booster, self.trees)
        self.trees += 1
        first = self.ensemble.segment_starts[-1]
        return self.ensemble.outputs(self.features, start=first + self.trees - 1)[:, 0]

    def finish(self) -> None:
        """Keep the segment as a plain model (drops the binned rows)."""
        if self.trees:
            lgb = lightgbm_module()

            self.ensemble.segments[-1] = lgb.Booster(model_str=self._booster.model_to_string())


def _leaf_values(node: dict[str, Any], num_leaves: int) -> np.ndarray:
    values = np.zeros(max(num_leaves, 1))
    stack = [node]
    while stack:
        node = stack.pop()
        if "leaf_value" in node:
            values[node.get("leaf_index", 0)] = node["leaf_value"]
        else:
            stack.extend((node["left_child"], node["right_child"]))
    return values
