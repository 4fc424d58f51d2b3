"""Training inside the enclave (and, with the same functions, on each provider and for the pooled peer).

Exact solvers so that the shared model can be checked against the pooled plaintext fit: linear least
squares (``lstsq``) and L2-regularised logistic regression by Newton's method (IRLS) to convergence. A
small torch MLP (binary classification, fixed seed and data order). In model-sharing mode the enclave
averages the providers' models weighted by their rows. A model is a dict of named numpy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from convoy.workloads.confidential.config import EnclaveConfig
from convoy.workloads.confidential.errors import MessageError

if TYPE_CHECKING:
    from torch import nn

Model = dict[str, np.ndarray]
NEWTON_TOL, NEWTON_MAX_ITER = 1e-12, 100


def with_intercept(x: np.ndarray) -> np.ndarray:
    return np.hstack([x, np.ones((x.shape[0], 1), dtype=x.dtype)])


def fit_linear(x: np.ndarray, y: np.ndarray) -> Model:
    """Least squares with an intercept (last coefficient)."""
    coef, *_ = np.linalg.lstsq(with_intercept(x), y, rcond=None)
    return {"coef": coef}


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-6) -> Model:
    """Newton/IRLS on the L2-penalised log-loss (intercept not penalised) until the step is below 1e-12."""
    design = with_intercept(x)
    coef = np.zeros(design.shape[1])
    penalty = np.full(design.shape[1], l2)
    penalty[-1] = 0.0
    for _ in range(NEWTON_MAX_ITER):
        prob = _sigmoid(design @ coef)
        gradient = design.T @ (prob - y) + penalty * coef
        hessian = design.T @ (design * (prob * (1.0 - prob))[:, None]) + np.diag(penalty)
        step = np.linalg.solve(hessian + 1e-12 * np.eye(len(coef)), gradient)
        coef = coef - step
        if np.max(np.abs(step)) < NEWTON_TOL * max(1.0, np.max(np.abs(coef))):
            break
    return {"coef": coef}


def mlp_shapes(features: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The MLP's parameter names and shapes (``features -> hidden -> hidden -> 1``), without importing torch."""
    return {"0.weight": (hidden, features), "0.bias": (hidden,), "2.weight": (hidden, hidden), "2.bias": (hidden,),
            "4.weight": (1, hidden), "4.bias": (1,)}


def _mlp(features: int, hidden: int) -> nn.Sequential:
    from torch import nn

    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 1))


def fit_mlp(x: np.ndarray, y: np.ndarray, config: EnclaveConfig, init: Model | None = None) -> Model:
    """Adam on binary cross-entropy, mini-batches in a seeded order; starts from ``init`` when given.

    One thread: the same bits wherever it runs (enclave, provider, pooled peer), and small batches run
    faster that way on a busy machine.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_mlp(torch, x, y, config, init)
    finally:
        torch.set_num_threads(threads)


def _train_mlp(torch: ModuleType, x: np.ndarray, y: np.ndarray, config: EnclaveConfig, init: Model | None) -> Model:
    torch.manual_seed(config.seed)
    net = _mlp(x.shape[1], config.hidden)
    if init is not None:
        net.load_state_dict({name: torch.as_tensor(value) for name, value in init.items()})
    inputs, targets = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32)
    optimizer = torch.optim.Adam(net.parameters(), lr=config.learning_rate)
    order = torch.Generator().manual_seed(config.seed)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(config.epochs):
        permutation = torch.randperm(len(inputs), generator=order)
        for start in range(0, len(inputs), config.batch_size):
            batch = permutation[start:start + config.batch_size]
            optimizer.zero_grad()
            loss_fn(net(inputs[batch]).squeeze(1), targets[batch]).backward()
            optimizer.step()
    return {name: value.detach().numpy().copy() for name, value in net.state_dict().items()}


def fit(config: EnclaveConfig, x: np.ndarray, y: np.ndarray, init: Model | None = None) -> Model:
    """Train ``config.task`` on one dataset (the pooled rows in the enclave, or one provider's own)."""
    if config.task == "linear":
        return fit_linear(x, y)
    if config.task == "logistic":
        return fit_logistic(x, y, config.l2)
    return fit_mlp(x, y, config, init)


def predict(config: EnclaveConfig, model: Model, x: np.ndarray) -> np.ndarray:
    """Regression values (linear) or probabilities of class 1 (logistic, mlp)."""
    if config.task in ("linear", "logistic"):
        z = with_intercept(x) @ model["coef"]
        return z if config.task == "linear" else _sigmoid(z)
    import torch

    net = _mlp(x.shape[1], config.hidden)
    net.load_state_dict({name: torch.as_tensor(value) for name, value in model.items()})
    with torch.no_grad():
        return torch.sigmoid(net(torch.as_tensor(x, dtype=torch.float32)).squeeze(1)).numpy().astype(np.float64)


def quality(config: EnclaveConfig, model: Model, x: np.ndarray, y: np.ndarray) -> float:
    """R^2 for regression, accuracy for classification: higher is better."""
    prediction = predict(config, model, x)
    if config.task == "linear":
        return float(1.0 - np.sum((y - prediction) ** 2) / np.sum((y - y.mean()) ** 2))
    return float(np.mean((prediction >= 0.5) == (y >= 0.5)))


def pool(datasets: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of every provider, in party order: the same order inside the enclave and for the plaintext peer."""
    return np.concatenate([x for x, _ in datasets]), np.concatenate([y for _, y in datasets])


def weighted_average(models: Sequence[Model], weights: Sequence[float]) -> Model:
    """Parameter-wise average of ``models`` weighted by ``weights`` (their rows)."""
    total = float(sum(weights))
    return {name: sum(model[name] * (weight / total) for model, weight in zip(models, weights, strict=True))
            for name in models[0]}


def model_shapes(config: EnclaveConfig) -> dict[str, tuple[int, ...]]:
    if config.task == "mlp":
        return mlp_shapes(config.features, config.hidden)
    return {"coef": (config.features + 1,)}


def check_data(config: EnclaveConfig, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A provider's rows, or MessageError saying what is wrong with them (nothing is trained on them then)."""
    if set(arrays) != {"x", "y"}:
        raise MessageError(f"data payload must hold exactly the arrays x and y (got {sorted(arrays)})")
    x, y = arrays["x"], arrays["y"]
    if x.dtype.kind != "f" or y.dtype.kind != "f":
        raise MessageError(f"x and y must be floating point (got {x.dtype} and {y.dtype})")
    if x.ndim != 2 or x.shape[1] != config.features or y.shape != (x.shape[0],) or x.shape[0] < 1:
        raise MessageError(f"x must be (rows, {config.features}) and y (rows,) with rows >= 1 (got {x.shape} "
                           f"and {y.shape})")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise MessageError("x or y holds NaN or infinity; clean the rows before sending them")
    if config.task != "linear" and not np.isin(y, (0.0, 1.0)).all():
        raise MessageError(f"{config.task} needs labels y in {{0, 1}}")
    return x.astype(np.float64), y.astype(np.float64)


def check_model(config: EnclaveConfig, arrays: dict[str, np.ndarray]) -> tuple[Model, float]:
    """A provider's local model and its row count, or MessageError saying what is wrong."""
    shapes = model_shapes(config)
    if set(arrays) != {*shapes, "n_samples"}:
        raise MessageError(f"model payload must hold {sorted(shapes)} and n_samples (got {sorted(arrays)})")
    n_samples = arrays["n_samples"]
    if n_samples.shape != () or n_samples.dtype.kind not in "iu" or int(n_samples) < 1:
        raise MessageError("n_samples must be one integer >= 1")
    model = {}
    for name, shape in shapes.items():
        value = arrays[name]
        if value.shape != shape or value.dtype.kind != "f" or not np.isfinite(value).all():
            raise MessageError(f"model parameter {name!r} must be finite floats of shape {shape} "
                               f"(got {value.dtype} {value.shape})")
        model[name] = value
    return model, float(int(n_samples))
