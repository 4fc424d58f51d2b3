"""Checks on what users hand in: finite 2-D features, finite 1-D targets, matching shapes, two classes."""

from __future__ import annotations

from typing import Any

import numpy as np

from convoy.workloads.gbdt.errors import GBDTDataError


def check_features(features: Any, num_features: int | None = None, what: str = "X") -> np.ndarray:
    """``features`` as a float64 (rows x features) array; raise ``GBDTDataError`` if unusable."""
    try:
        array = np.asarray(features, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise GBDTDataError(f"{what} must be numbers: {exc}") from exc
    if array.ndim == 1 and num_features is not None and array.size == num_features:
        array = array.reshape(1, -1)
    if array.ndim != 2:
        raise GBDTDataError(f"{what} must be a 2-D array (rows x features), got shape {array.shape}")
    if array.shape[0] == 0:
        raise GBDTDataError(f"{what} is empty (0 rows); pass at least one row")
    if array.shape[1] == 0:
        raise GBDTDataError(f"{what} has no feature columns")
    if num_features is not None and array.shape[1] != num_features:
        raise GBDTDataError(f"{what} has {array.shape[1]} features but the model was trained on {num_features}; "
                            "pass the same columns in the same order")
    bad = ~np.isfinite(array)
    if bad.any():
        row, column = map(int, np.argwhere(bad)[0])
        raise GBDTDataError(f"{what} has {int(bad.sum())} NaN/inf value(s), first at row {row}, column {column}; "
                            "impute or drop them first")
    return array


def check_target(target: Any, num_rows: int, what: str = "y") -> np.ndarray:
    """``target`` as a float64 vector of ``num_rows`` finite values."""
    try:
        array = np.asarray(target, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise GBDTDataError(f"{what} must be numbers: {exc}") from exc
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        raise GBDTDataError(f"{what} must be 1-D (one target per row), got shape {array.shape}")
    if len(array) != num_rows:
        raise GBDTDataError(f"{what} has {len(array)} values for {num_rows} rows of features; they must match")
    bad = ~np.isfinite(array)
    if bad.any():
        raise GBDTDataError(f"{what} has {int(bad.sum())} NaN/inf value(s), first at row {int(np.argmax(bad))}; "
                            "drop those rows")
    return array


def check_labels(labels: Any, num_rows: int, what: str = "y") -> np.ndarray:
    """Class labels of any type (numbers, strings, booleans) as a vector of ``num_rows``; numbers must be finite."""
    array = np.asarray(labels)
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        raise GBDTDataError(f"{what} must be 1-D (one label per row), got shape {array.shape}")
    if len(array) != num_rows:
        raise GBDTDataError(f"{what} has {len(array)} values for {num_rows} rows of features; they must match")
    if array.dtype.kind == "O":
        raise GBDTDataError(f"{what} mixes types; use numbers or strings for the two classes")
    if array.dtype.kind in "fc":
        check_target(array, num_rows, what)
    return array


def binary_labels(target: np.ndarray, classes: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Map a two-class target onto 0/1 (``classes[1]`` is 1); ``classes`` fixed by ``fit`` (None: take them
    from ``target``, sorted)."""
    found = np.unique(target)
    if classes is None:
        if len(found) != 2:
            raise GBDTDataError(f"the classifier needs a binary target with exactly 2 distinct values, got "
                                f"{len(found)}: {found[:5].tolist()}{' ...' if len(found) > 5 else ''}; "
                                "use the regressor for a numeric target")
        classes = found
    unknown = np.setdiff1d(found, classes)
    if len(unknown):
        raise GBDTDataError(f"target values {unknown[:5].tolist()} are not among the classes the model was fitted on "
                            f"({classes.tolist()})")
    return (target == classes[1]).astype(np.float64), classes
