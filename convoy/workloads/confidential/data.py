"""Synthetic providers whose data differ: each sees only its own slice of the feature space.

Every provider draws features near its own low-dimensional subspace (a provider-specific mixing of
``features // 2`` latent factors, plus a little noise, around its own mean), so it cannot pin down the
coefficients along the directions it barely varies in. The label follows one rule for everyone, with a
part no linear model captures (for linear regression, a small interaction; for the MLP, a curve), so
the best model for one provider's region differs from the best for another's. A provider's local model
therefore extrapolates badly to the others' rows; the model trained on all rows does not. The held-out
test set mixes every provider's distribution equally.
"""

from __future__ import annotations

import numpy as np

from convoy.errors import ConfigError

Dataset = tuple[np.ndarray, np.ndarray]
NOISE_OFF_SUBSPACE = 0.05


def _features(rng: np.random.Generator, rows: int, mean: np.ndarray, mixing: np.ndarray) -> np.ndarray:
    latent = rng.standard_normal((rows, mixing.shape[0]))
    return mean + latent @ mixing + NOISE_OFF_SUBSPACE * rng.standard_normal((rows, mixing.shape[1]))


def _labels(task: str, rng: np.random.Generator, x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    score = x @ weights / np.sqrt(len(weights))
    if task == "linear":  # with a small interaction no line fits everywhere: each region's best line differs
        return 2.0 * score + 0.5 + 0.25 * x[:, 0] * x[:, 1] + 0.3 * rng.standard_normal(len(x))
    if task == "logistic":
        return (rng.random(len(x)) < 1.0 / (1.0 + np.exp(-4.0 * score))).astype(np.float64)
    curve = np.sin(2.0 * score) + 0.5 * (x[:, 0] * x[:, 1] / 2.0)  # mlp: a rule no linear model fits
    flip = rng.random(len(x)) < 0.03
    return ((curve > 0) ^ flip).astype(np.float64)


def make_providers(task: str, providers: int = 3, rows: int = 1000, features: int = 8, seed: int = 0,
                   test_rows: int = 3000) -> tuple[list[Dataset], Dataset]:
    """``providers`` datasets of ``rows`` rows each, and a test set of ``test_rows`` drawn from all of them."""
    if providers < 1 or rows < 2 or features < 2 or test_rows < providers:
        raise ConfigError(f"need providers >= 1, rows >= 2, features >= 2 and test_rows >= providers "
                          f"(got {providers}, {rows}, {features}, {test_rows})")
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(features)
    latent = max(1, features // 2)
    shapes = [(rng.normal(0.0, 1.0, features), rng.standard_normal((latent, features))) for _ in range(providers)]
    datasets = []
    for mean, mixing in shapes:
        x = _features(rng, rows, mean, mixing)
        datasets.append((x, _labels(task, rng, x, weights)))
    per_provider = test_rows // providers
    test_x = np.concatenate([_features(rng, per_provider, mean, mixing) for mean, mixing in shapes])
    return datasets, (test_x, _labels(task, rng, test_x, weights))
