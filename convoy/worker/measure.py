"""The measuring iteration, marked from inside a training script: ``with convoy.measure_iteration(...)``.

A role whose count or memory is ``auto`` is sized from its rank 0's one iteration: this module tells the agent
(by worker events on stderr, which its log pump reads at once) when that iteration begins and ends and what it
is made of, with the process tree's memory as the process itself read it at that moment (the agent reads the
lines a little later, when the iteration may have begun allocating); the agent samples the tree and reports
the peak. Outside a measured process (another rank,
plain ``python``) the calls only print their marked lines. Torch-free: a model is only asked for its
parameters, and on a GPU ``torch.cuda`` (where the script imported torch) for the iteration's reserved peak.
"""

from __future__ import annotations

import json
import os
import sys
from types import TracebackType
from typing import Any

from convoy.procs import sample_tree
from convoy.worker.events import emit

BASELINE, BEGIN, END = "memory_baseline", "measure_begin", "measure_end"
"""The worker events of the measurement (the agent's ``role_memory`` takes them, the master never sees them)."""


def memory_baseline() -> None:
    """Mark the process's baseline (imports done, data pipeline up, model not built yet); without it the
    baseline is the process as its measuring iteration begins."""
    emit(BASELINE, json.dumps(_tree_now()))


def _tree_now() -> dict[str, int]:
    """This process tree's RSS, USS and PSS now (``/proc``; a few milliseconds for a process that imported torch)."""
    now = sample_tree(os.getpid())
    return {"rss_bytes": now.rss_bytes, "uss_bytes": now.uss_bytes, "pss_bytes": now.pss_bytes}


def state_bytes_of(model: Any, optimizer_slots: int = 0) -> int:
    """Bytes of model state one process holds: its parameters, their gradients, and ``optimizer_slots`` tensors
    of the same size per parameter (SGD 0, SGD with momentum 1, Adam 2)."""
    params = sum(int(param.numel()) * int(param.element_size()) for param in model.parameters())
    return params * (2 + optimizer_slots)


class measure_iteration:  # noqa: N801 (used as a function: ``with convoy.measure_iteration(...)``)
    """Marks one iteration as the measuring one, as a context manager or by ``begin()`` and ``end()``.

    ``batch_size`` x ``sample_bytes``: the input the iteration loads; ``state_bytes``: the model state the
    process holds (or give ``model`` and ``optimizer_slots``); ``activation_bytes``: the iteration's bytes that
    grow with the batch, where the script measured them. An iteration that raises is not ended: the job fails
    naming the measuring iteration.
    """

    def __init__(self, batch_size: int, sample_bytes: int, state_bytes: int | None = None, model: Any = None,
                 optimizer_slots: int = 0, activation_bytes: int | None = None) -> None:
        if state_bytes is None:
            state_bytes = state_bytes_of(model, optimizer_slots) if model is not None else 0
        if batch_size < 1 or sample_bytes < 1 or state_bytes < 0:
            raise ValueError(f"measure_iteration: batch_size {batch_size} and sample_bytes {sample_bytes} must be "
                             f"at least 1, state_bytes {state_bytes} at least 0")
        self.shape = {"batch_size": int(batch_size), "sample_bytes": int(sample_bytes),
                      "state_bytes": int(state_bytes)}
        self.activation_bytes = activation_bytes

    def begin(self) -> measure_iteration:
        cuda = _cuda_in_use()
        if cuda is not None:
            cuda.reset_peak_memory_stats()
        emit(BEGIN, json.dumps({**self.shape, "baseline": _tree_now()}))
        return self

    def end(self) -> None:
        cuda = _cuda_in_use()
        gpu_peak = int(cuda.max_memory_reserved()) if cuda is not None else None
        emit(END, json.dumps({"activation_bytes": self.activation_bytes, "gpu_peak_bytes": gpu_peak}))

    def __enter__(self) -> measure_iteration:
        return self.begin()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is None:
            self.end()


def _cuda_in_use() -> Any:
    """``torch.cuda`` where the script already uses a GPU (torch imported, CUDA initialised), else None: the
    measuring iteration's GPU peak is then what the caching allocator reserved (``max_memory_reserved``)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_available() or not cuda.is_initialized():
        return None
    return cuda
