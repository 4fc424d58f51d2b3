"""convoy: automatic, elastic distributed training for PyTorch.

The control plane (``convoy.control``, ``convoy.agent``) never imports torch, so importing
this package is cheap; ``convoy.init`` and ``convoy.Checkpointer`` load the torch side on
first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Checkpointer", "Context", "CrossGroup", "RoleInfo", "accelerate", "attention", "exit_without_teardown",
           "hot", "init", "join_group", "measure_iteration", "memory_baseline", "positions", "report", "restart",
           "role", "roles", "scale", "shards", "train_config", "train_step"]

_LAZY = {
    "init": "convoy.runtime.init",
    "Context": "convoy.runtime.init",
    "Checkpointer": "convoy.runtime.checkpoint",
    "exit_without_teardown": "convoy.procs",
    "role": "convoy.worker.role_env",
    "RoleInfo": "convoy.worker.role_env",
    "measure_iteration": "convoy.worker.measure",
    "memory_baseline": "convoy.worker.measure",
    "shards": "convoy.worker.shards",
    "scale": "convoy.worker.scaling",
    "join_group": "convoy.runtime.cross_group",
    "CrossGroup": "convoy.runtime.cross_group",
    "roles": "convoy.worker.scaling",
    "report": "convoy.worker.report",
    "train_config": "convoy.worker.live_config",
    "hot": "convoy.worker.live_config",
    "restart": "convoy.worker.live_config",
    "accelerate": "convoy.strategy.apply",
    "train_step": "convoy.strategy.apply",
    "attention": "convoy.parallel.sequence.shard",
    "positions": "convoy.parallel.sequence.shard",
}


def __getattr__(name: str) -> Any:
    """A public name's first use imports its module; the name is then kept here (``convoy.report`` is called every
    step: a module lookup each time would cost the training loop)."""
    if name in _LAZY:
        import importlib

        value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'convoy' has no attribute {name!r}")
