"""The model file: one UTF-8 JSON object, so that it can be read, diffed and checked by hand.

Fields (version 1):

- ``format``: ``"convoy-gbdt"``; ``version``: 1.
- ``estimator``: ``"OrthogonalBoostingRegressor"`` or ``"OrthogonalBoostingClassifier"``.
- ``params``: the constructor's arguments; ``classes``: the classifier's two labels (null for the regressor).
- ``num_features``, ``ridge`` (chosen per-row penalty), ``reference_loss`` (validation loss the drift test is
  relative to), ``rows_seen``, ``drifts``, ``collecting`` (true while rows are being collected to grow on).
- ``online``: ``weights`` (intercept first, then one per tree), ``gram`` (K+1 x K+1), ``moment``, ``rows``,
  ``forgetting``, ``ridge``: the least-squares-with-forgetting state.
- ``drift``: the Page-Hinkley state; ``window``: ``features`` (rows x features) and ``target`` of the rows
  collected since the last detection (empty unless ``collecting``).
- ``trees``: a list of segments, each a LightGBM text model (the offline trees first, then one segment per
  drift-triggered growth); numbering the trees across segments in order, tree k is weighted by
  ``online.weights[k + 1]``. LightGBM's own leaf values are the learner outputs (its learning rate is 1).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from convoy.workloads.gbdt.drift import PageHinkley
from convoy.workloads.gbdt.errors import GBDTModelError
from convoy.workloads.gbdt.online import GrowthWindow, OnlineWeights
from convoy.workloads.gbdt.trees import TreeEnsemble

FORMAT, VERSION = "convoy-gbdt", 1


def model_document(model: Any) -> dict[str, Any]:
    """The JSON-ready description of a fitted model."""
    model._check_fitted()
    classes = getattr(model, "classes_", None)
    return {
        "format": FORMAT, "version": VERSION, "estimator": type(model).__name__, "params": model.get_params(),
        "classes": None if classes is None else classes.tolist(), "num_features": model.n_features_in_,
        "ridge": model.ridge_, "reference_loss": model.reference_loss_, "rows_seen": model.rows_seen_,
        "drifts": model.drifts_, "collecting": model.collecting_, "online": model.online_.state(),
        "drift": model.detector_.state(), "window": _window_document(model),
        "trees": model.trees_.to_strings(),
    }


def save_model(model: Any, path: Path) -> None:
    """Write atomically: a crash mid-save leaves the old file in place."""
    text = json.dumps(model_document(model), allow_nan=False)
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    except OSError as exc:
        raise GBDTModelError(f"cannot write the model to {str(path)!r}: {exc}") from exc


def load_model(path: Path) -> Any:
    """Read a file written by ``save_model``; raise ``GBDTModelError`` naming what is wrong with it."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise GBDTModelError(f"no model file at {str(path)!r}; train one with `convoy gbdt train`") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GBDTModelError(f"{str(path)!r} is not a readable convoy gbdt model: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise GBDTModelError(f"{str(path)!r} is not a convoy gbdt model (no format {FORMAT!r})")
    if document.get("version") != VERSION:
        raise GBDTModelError(f"{str(path)!r} has model format version {document.get('version')}; this convoy reads "
                             f"version {VERSION}")
    try:
        return model_from_document(document)
    except (KeyError, TypeError, ValueError) as exc:
        raise GBDTModelError(f"{str(path)!r} is a damaged convoy gbdt model ({type(exc).__name__}: {exc})") from exc


def model_from_document(document: dict[str, Any]) -> Any:
    from convoy.workloads.gbdt.model import OrthogonalBoostingClassifier, OrthogonalBoostingRegressor

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


def _window_document(model: Any) -> dict[str, list]:
    if not model.window_.num_rows:
        return {"features": [], "target": []}
    features, target, _ = model.window_.arrays()
    return {"features": features.tolist(), "target": target.tolist()}
