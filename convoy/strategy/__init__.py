"""Automatic strategy search: features, candidates, memory and cost models, the measured search.

``Workload`` and ``Strategy`` load without torch's distributed parts; ``convoy.accelerate`` and
``convoy.train_step`` (``apply.py``) wrap a model as a strategy says."""

from __future__ import annotations

from typing import Any

from convoy.strategy.plan import Strategy, StrategyFile

__all__ = ["Strategy", "StrategyFile", "Workload"]


def __getattr__(name: str) -> Any:
    if name == "Workload":
        from convoy.strategy.workload import Workload

        return Workload
    raise AttributeError(f"module 'convoy.strategy' has no attribute {name!r}")
