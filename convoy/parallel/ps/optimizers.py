"""The update rules a parameter server applies to pushed gradients. Dense tensors follow ``torch.optim``'s SGD,
Adagrad and Adam; table rows follow torch's sparse-gradient path for the same optimizers (SGD and Adagrad on a
sparse gradient, ``SparseAdam``), so only the pushed rows and their rows of state change. A worker's model trained
through the servers thus matches the same model trained by torch in one process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from convoy.errors import ConfigError

OPTIMIZERS = ("sgd", "adagrad", "adam")


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer every server runs on its shard."""

    name: str
    """One of ``sgd``, ``adagrad``, ``adam``."""
    lr: float
    """Learning rate, > 0."""
    eps: float = 1e-10
    """Adagrad's and Adam's epsilon (torch's default for Adagrad; pass 1e-8 to match torch's Adam)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's moment decay rates, each in [0, 1)."""
    initial_accumulator: float = 0.0
    """Adagrad's starting sum of squares, >= 0."""

    def validate(self) -> OptimizerSpec:
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"parameter-server optimizer {self.name!r} is unknown; use one of {list(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ConfigError(f"parameter-server optimizer {self.name}: lr must be > 0 (got {self.lr})")
        if not self.eps > 0:
            raise ConfigError(f"parameter-server optimizer {self.name}: eps must be > 0 (got {self.eps})")
        if not all(0.0 <= beta < 1.0 for beta in self.betas) or len(self.betas) != 2:
            raise ConfigError(f"parameter-server optimizer adam: betas must be two values in [0, 1) "
                              f"(got {self.betas})")
        if self.initial_accumulator < 0:
            raise ConfigError(f"parameter-server optimizer adagrad: initial_accumulator must be >= 0 "
                              f"(got {self.initial_accumulator})")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "eps": self.eps, "betas": list(self.betas),
                "initial_accumulator": self.initial_accumulator}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> OptimizerSpec:
        return OptimizerSpec(str(data["name"]), float(data["lr"]), float(data["eps"]),
                             (float(data["betas"][0]), float(data["betas"][1])),
                             float(data["initial_accumulator"])).validate()


def new_state(spec: OptimizerSpec, param: torch.Tensor) -> dict[str, Any]:
    """The optimizer state of one dense tensor or one table shard (one row of state per row)."""
    if spec.name == "adagrad":
        return {"step": 0, "sum": torch.full_like(param, spec.initial_accumulator)}
    if spec.name == "adam":
        return {"step": 0, "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
    return {"step": 0}


@torch.no_grad()
def apply_dense(spec: OptimizerSpec, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> None:
    """One step of ``torch.optim.<name>`` (defaults otherwise) on ``param`` in place."""
    state["step"] += 1
    if spec.name == "sgd":
        param.add_(grad, alpha=-spec.lr)
    elif spec.name == "adagrad":
        state["sum"].addcmul_(grad, grad, value=1.0)
        param.addcdiv_(grad, state["sum"].sqrt().add_(spec.eps), value=-spec.lr)
    else:
        beta1, beta2 = spec.betas
        step = state["step"]
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denominator = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(spec.eps)
        param.addcdiv_(state["exp_avg"], denominator, value=-spec.lr / bias_correction1)


@torch.no_grad()
def apply_rows(spec: OptimizerSpec, table: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor,
               state: dict[str, Any]) -> None:
    """One sparse step on the distinct local ``rows`` of ``table`` (``grads`` already summed per row), as torch
    applies a coalesced sparse gradient; rows not pushed keep their values and their state."""
    state["step"] += 1
    if spec.name == "sgd":
        table.index_add_(0, rows, grads, alpha=-spec.lr)
    elif spec.name == "adagrad":
        total = state["sum"]
        total.index_add_(0, rows, grads * grads)
        table.index_add_(0, rows, grads / total[rows].sqrt().add_(spec.eps), alpha=-spec.lr)
    else:
        beta1, beta2 = spec.betas
        step = state["step"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        old_avg, old_avg_sq = exp_avg[rows], exp_avg_sq[rows]
        avg_update = (grads - old_avg).mul_(1 - beta1)
        avg_sq_update = (grads * grads - old_avg_sq).mul_(1 - beta2)
        exp_avg.index_add_(0, rows, avg_update)
        exp_avg_sq.index_add_(0, rows, avg_sq_update)
        numerator = avg_update.add_(old_avg)
        denominator = avg_sq_update.add_(old_avg_sq).sqrt_().add_(spec.eps)
        step_size = spec.lr * (1 - beta2 ** step) ** 0.5 / (1 - beta1 ** step)
        table.index_add_(0, rows, numerator.div_(denominator), alpha=-step_size)
