"""What a ``convoy.Checkpointer`` snapshot captures besides the model and optimizer (RNG streams, extra
stateful objects), which ranks hold interchangeable copies, and how a saved state is checked against the live one."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from typing import Any

import torch

from convoy.errors import CheckpointError


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Set each stream ``state`` holds (a checkpoint of another setup may lack some)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def extra_state(obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    return obj.state_dict()


def load_extra(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    else:
        obj.load_state_dict(state)


def peer_sets(replicated: bool | Sequence[Sequence[int]], world_size: int) -> list[tuple[int, ...]]:
    """``True``: one set of all ranks; ``False``: each rank alone; else the sets given, checked to
    be a partition of ``0..world_size-1``."""
    if isinstance(replicated, bool):
        return [tuple(range(world_size))] if replicated else [(rank,) for rank in range(world_size)]
    sets = [tuple(int(rank) for rank in peers) for peers in replicated]
    listed = sorted(rank for peers in sets for rank in peers)
    if listed != list(range(world_size)) or not all(sets):
        raise CheckpointError(f"replicated={sets} must put every rank 0..{world_size - 1} in exactly one "
                              "non-empty set of peers")
    return sets


def shape_mismatch(live: Any, saved: Any, where: str) -> str | None:
    """Where the saved state's structure or tensor shapes differ from the live one, or None."""
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != live.shape or saved.dtype != live.dtype:
            got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            return f"{where}: saved {got}, model {tuple(live.shape)}"
        return None
    if isinstance(live, dict):
        if not isinstance(saved, dict) or set(live) != set(saved):
            return f"{where}: saved keys {sorted(map(str, set(saved) ^ set(live)))[:3]} differ"
        for key in live:
            problem = shape_mismatch(live[key], saved[key], f"{where}.{key}")
            if problem:
                return problem
    return None
