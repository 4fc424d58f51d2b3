"""The enclave's solvers and the synthetic providers: exact where they claim to be, and the shared model
better than any provider's own."""

from __future__ import annotations

import numpy as np
import pytest

from convoy.errors import ConfigError
from convoy.workloads.confidential.config import EnclaveConfig, Party
from convoy.workloads.confidential.data import make_providers
from convoy.workloads.confidential.errors import MessageError
from convoy.workloads.confidential.platform import (
    check_model, fit, fit_linear, fit_logistic, mlp_shapes, pool, quality, weighted_average, with_intercept,
)


def test_linear_recovers_exact_coefficients_from_noiseless_rows() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 3))
    coef = np.array([1.5, -2.0, 0.25, 3.0])
    assert np.allclose(fit_linear(x, with_intercept(x) @ coef)["coef"], coef, atol=1e-12)


def test_logistic_newton_reaches_the_optimum() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((400, 3))
    y = (rng.random(400) < 1 / (1 + np.exp(-(x @ [2.0, -1.0, 0.5] + 0.3)))).astype(float)
    l2 = 1e-3
    coef = fit_logistic(x, y, l2)["coef"]
    design = with_intercept(x)
    prob = 1 / (1 + np.exp(-design @ coef))
    gradient = design.T @ (prob - y) + np.r_[l2 * coef[:-1], 0.0]
    assert np.max(np.abs(gradient)) < 1e-9


def test_weighted_average_weights_by_rows() -> None:
    averaged = weighted_average([{"w": np.array([0.0, 4.0])}, {"w": np.array([4.0, 0.0])}], [3, 1])
    assert averaged["w"].tolist() == [1.0, 3.0]


@pytest.mark.parametrize("task", ["linear", "logistic"])
def test_shared_model_beats_every_local_model_on_everyones_rows(task: str) -> None:
    datasets, (test_x, test_y) = make_providers(task, 3, 400, 6, seed=2)
    config = EnclaveConfig(task=task, features=6, parties=(Party("a", "11" * 32),))
    shared = quality(config, fit(config, *pool(datasets)), test_x, test_y)
    assert all(shared > quality(config, fit(config, x, y), test_x, test_y) for x, y in datasets)


def test_mlp_training_is_deterministic_for_a_seed() -> None:
    datasets, _ = make_providers("mlp", 2, 100, 4, seed=5)
    config = EnclaveConfig(task="mlp", features=4, hidden=8, epochs=2, parties=(Party("a", "11" * 32),))
    first, second = fit(config, *pool(datasets)), fit(config, *pool(datasets))
    assert {name: value.shape for name, value in first.items()} == mlp_shapes(4, 8)
    assert all(np.array_equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize(("arrays", "expected"), [
    ({"coef": np.zeros(5)}, "n_samples"),
    ({"coef": np.zeros(5), "n_samples": np.asarray(0)}, "n_samples must be one integer >= 1"),
    ({"coef": np.zeros(4), "n_samples": np.asarray(3)}, "'coef' must be finite floats of shape (5,)"),
    ({"coef": np.full(5, np.inf), "n_samples": np.asarray(3)}, "must be finite"),
])
def test_a_bad_local_model_is_refused(arrays: dict, expected: str) -> None:
    config = EnclaveConfig(task="linear", mode="model", features=4, parties=(Party("a", "11" * 32),))
    with pytest.raises(MessageError) as caught:
        check_model(config, arrays)
    assert expected in str(caught.value)


@pytest.mark.parametrize(("change", "expected"), [
    ({"task": "svm"}, "task 'svm' is unknown"),
    ({"parties": ()}, "parties must be one or more"),
    ({"parties": (Party("a", "11" * 32), Party("a", "22" * 32))}, "distinct"),
    ({"parties": (Party("a", "xyz"),)}, "64 lowercase hex digits"),
    ({"rounds": 2}, "data mode trains once"),
    ({"features": 0}, "features must be an integer >= 1"),
])
def test_a_bad_configuration_names_the_field(change: dict, expected: str) -> None:
    fields = {"parties": (Party("a", "11" * 32),), **change}
    with pytest.raises(ConfigError, match=expected):
        EnclaveConfig(**fields).validate()
