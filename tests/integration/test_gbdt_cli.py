"""``convoy gbdt train | update | predict`` end to end in real processes, and its one-line errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import ProcessScope, one_error_line

pytestmark = pytest.mark.slow


def write_csv(path: Path, features: np.ndarray, target: np.ndarray | None) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([f"x{i}" for i in range(features.shape[1])] + (["label"] if target is not None else []))
        for index, row in enumerate(features):
            writer.writerow([*map(repr, row.tolist()), *([repr(float(target[index]))] if target is not None else [])])


def rows(count: int, seed: int, drifted: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.uniform(size=(count, 4))
    slope = -6.0 if drifted else 6.0
    return features, slope * features[:, 0] + np.sin(5 * features[:, 1]) + 4 * drifted * features[:, 3]


def test_train_update_predict_from_files(procs: ProcessScope, tmp_path: Path) -> None:
    features, target = rows(1500, 0, drifted=False)
    np.savez(tmp_path / "train.npz", X=features, y=target)
    after = rows(3000, 1, drifted=True)
    write_csv(tmp_path / "stream.csv", *after)
    write_csv(tmp_path / "probe.csv", after[0][:50], None)
    model = tmp_path / "model.json"

    trained = procs.run(["gbdt", "train", "--data", tmp_path / "train.npz", "--model", model, "--learners", "30",
                         "--min-data-in-leaf", "20"])
    assert trained.returncode == 0, trained.explain()
    assert "trained 30 learners on 1500 rows x 4 features" in trained.stdout

    before = procs.run(["gbdt", "predict", "--model", model, "--data", tmp_path / "probe.csv"])
    assert before.returncode == 0, before.explain()
    updated = procs.run(["gbdt", "update", "--model", model, "--data", tmp_path / "stream.csv", "--target", "label",
                         "--batch-rows", "250"])
    assert updated.returncode == 0, updated.explain()
    assert "1 drift(s) detected" in updated.stdout and json.loads(model.read_text())["drifts"] == 1

    after_update = procs.run(["gbdt", "predict", "--model", model, "--data", tmp_path / "probe.csv", "--out",
                              tmp_path / "predictions.csv"])
    assert after_update.returncode == 0, after_update.explain()
    old = np.array(before.stdout.split()[1:], dtype=float)
    new = np.loadtxt(tmp_path / "predictions.csv", skiprows=1)
    truth = after[1][:50]
    assert old.shape == new.shape == (50,)
    assert np.sqrt(np.mean((new - truth) ** 2)) < 0.5 * np.sqrt(np.mean((old - truth) ** 2))


def test_classifier_probabilities(procs: ProcessScope, tmp_path: Path) -> None:
    features, target = rows(1000, 2, drifted=False)
    write_csv(tmp_path / "train.csv", features, (target > np.median(target)).astype(float))
    model = tmp_path / "clf.json"
    trained = procs.run(["gbdt", "train", "--task", "classification", "--data", tmp_path / "train.csv", "--target",
                         "label", "--model", model, "--learners", "15", "--min-data-in-leaf", "20"])
    assert trained.returncode == 0, trained.explain()
    predicted = procs.run(["gbdt", "predict", "--model", model, "--data", tmp_path / "train.csv", "--target", "label",
                           "--proba"])
    probabilities = np.array(predicted.stdout.split()[1:], dtype=float)
    assert predicted.stdout.startswith("probability") and len(probabilities) == 1000
    assert ((probabilities > 0) & (probabilities < 1)).all()


def test_bad_input_is_one_line_and_exit_code_2(procs: ProcessScope, tmp_path: Path) -> None:
    features, target = rows(300, 3, drifted=False)
    features[10, 1] = np.nan
    write_csv(tmp_path / "nan.csv", features, target)
    result = procs.run(["gbdt", "train", "--data", tmp_path / "nan.csv", "--target", "label", "--model",
                        tmp_path / "m.json"])
    assert "NaN/inf" in one_error_line(result) and "row 10, column 1" in result.stderr
    result = procs.run(["gbdt", "train", "--data", tmp_path / "nan.csv", "--model", tmp_path / "m.json"])
    assert "no column 'target'" in one_error_line(result)
    result = procs.run(["gbdt", "predict", "--model", tmp_path / "missing.json", "--data", tmp_path / "nan.csv"])
    assert "no model file" in one_error_line(result)
    assert not (tmp_path / "m.json").exists()
