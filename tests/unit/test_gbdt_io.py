"""Save/load: a loaded model predicts and keeps learning exactly like the one that was saved."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from convoy.workloads.gbdt import GBDTModelError, OrthogonalBoostingClassifier, OrthogonalBoostingRegressor
from convoy.workloads.gbdt.model import OrthogonalBoosting

SMALL = {"n_learners": 25, "min_data_in_leaf": 20, "growth_rows": 600, "learners_per_drift": 3}


def data(rows: int, seed: int, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.uniform(size=(rows, 4))
    return features, 5 * features[:, 0] + np.sin(6 * features[:, 1]) + shift * features[:, 3] + rng.normal(0, .3, rows)


def test_round_trip_then_identical_predictions_and_identical_learning(tmp_path: Path) -> None:
    model = OrthogonalBoostingRegressor(**SMALL).fit(*data(1500, 0))
    drifted = data(1400, 1, shift=-12.0)
    model.partial_fit(drifted[0][:200], drifted[1][:200])
    model.partial_fit(drifted[0][200:400], drifted[1][200:400])  # detected: now collecting rows to grow on
    assert model.collecting_
    model.save(tmp_path / "model.json")
    loaded = OrthogonalBoosting.load(tmp_path / "model.json")
    assert isinstance(loaded, OrthogonalBoostingRegressor) and loaded.get_params() == model.get_params()
    probe = data(300, 2)[0]
    np.testing.assert_array_equal(loaded.predict(probe), model.predict(probe))
    for twin in (model, loaded):
        twin.partial_fit(drifted[0][400:], drifted[1][400:])  # the window fills: both grow the same learners
    assert loaded.n_learners_ == model.n_learners_ > 25
    np.testing.assert_allclose(loaded.predict(probe), model.predict(probe), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(loaded.feature_importances_, model.feature_importances_, rtol=1e-12)


def test_classifier_round_trip_keeps_its_labels(tmp_path: Path) -> None:
    features, target = data(1200, 3)
    labels = np.where(target > np.median(target), 7, 3)
    model = OrthogonalBoostingClassifier(**SMALL).fit(features, labels)
    model.save(tmp_path / "clf.json")
    loaded = OrthogonalBoostingClassifier.load(tmp_path / "clf.json")
    assert isinstance(loaded, OrthogonalBoostingClassifier) and loaded.classes_.tolist() == [3, 7]
    np.testing.assert_array_equal(loaded.predict_proba(features), model.predict_proba(features))
    assert set(loaded.predict(features)) == {3, 7}


def test_the_file_is_the_documented_json(tmp_path: Path) -> None:
    model = OrthogonalBoostingRegressor(**SMALL).fit(*data(800, 4))
    model.save(tmp_path / "model.json")
    document = json.loads((tmp_path / "model.json").read_text())
    assert (document["format"], document["version"], document["estimator"]) == (
        "convoy-gbdt", 1, "OrthogonalBoostingRegressor")
    assert len(document["online"]["weights"]) == 26 and len(document["trees"]) == 1
    assert document["trees"][0].startswith("tree")  # LightGBM's text model format


@pytest.mark.parametrize("content, message", [
    (None, "no model file"),
    ("{not json", "not a readable"),
    ('{"format": "other"}', "not a convoy gbdt model"),
    ('{"format": "convoy-gbdt", "version": 99}', "version 99"),
    ('{"format": "convoy-gbdt", "version": 1, "estimator": "OrthogonalBoostingRegressor"}', "damaged"),
])
def test_unusable_files_raise_a_clear_error(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "model.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(GBDTModelError, match=message):
        OrthogonalBoosting.load(path)


def test_weights_that_do_not_match_the_trees_are_rejected(tmp_path: Path) -> None:
    model = OrthogonalBoostingRegressor(**SMALL).fit(*data(800, 5))
    model.save(tmp_path / "model.json")
    document = json.loads((tmp_path / "model.json").read_text())
    online = document["online"]
    online["weights"] = online["weights"][:-1]
    (tmp_path / "model.json").write_text(json.dumps(document))
    with pytest.raises(GBDTModelError, match="damaged.*25 weights, a gram of shape"):
        OrthogonalBoosting.load(tmp_path / "model.json")
    online["moment"] = online["moment"][:-1]
    online["gram"] = [row[:-1] for row in online["gram"][:-1]]
    (tmp_path / "model.json").write_text(json.dumps(document))
    with pytest.raises(GBDTModelError, match="damaged.*25 weights for 25 trees"):
        OrthogonalBoosting.load(tmp_path / "model.json")
