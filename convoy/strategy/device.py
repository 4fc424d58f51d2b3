"""Where a planned model trains, taken from the model itself (the device of its parameters), and what follows from
it for the strategy search and ``convoy.accelerate``: autocast on that device's type, DDP bound to that GPU, batches
moved there, the memory limit (the GPU's own memory on CUDA, the host's limit on the CPU) and the measured peak
(``torch.cuda.max_memory_allocated`` on CUDA, the process's resident high-water mark on the CPU).

A model on the CPU keeps every CPU path as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from convoy.strategy.workload import peak_rss, release_free, reset_peak, rss


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for a model that holds neither."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def on_device(value: Any, device: torch.device) -> Any:
    """A batch (tensors, or lists, tuples and dicts of them) on ``device``; the same objects where they are."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: on_device(item, device) for key, item in value.items()}
    return value


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager[Any]:
    """bfloat16 autocast on the device's own type where the strategy says bf16; nothing otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def ddp_options(device: torch.device) -> dict[str, Any]:
    """DDP bound to the model's GPU (its own stream and buckets there); nothing for the CPU."""
    return {"device_ids": [device.index], "output_device": device.index} if device.type == "cuda" else {}


def memory_limit(device: torch.device, host_limit: float) -> float:
    """Bytes a rank may use for training: the GPU's memory on CUDA (the host's limit does not bound it), else the
    host's limit as the planner was given it."""
    if device.type != "cuda":
        return host_limit
    _, total = torch.cuda.mem_get_info(device)
    return float(total)


class PeakMemory:
    """A run's peak memory above its baseline, measured where the model's tensors live."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.before = 0

    def baseline(self) -> None:
        """What the process holds before the run (after the allocator hands back what earlier runs freed)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.before = torch.cuda.memory_allocated(self.device)
        else:
            release_free()
            self.before = rss()

    def reset(self) -> None:
        """A new high-water mark from now."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak()

    def peak(self) -> int:
        """The most held since ``reset``, above the baseline."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.before
        return peak_rss() - self.before


@contextlib.contextmanager
def timed_on(device: torch.device) -> Iterator[None]:
    """A span whose end waits for the device's queued work (a CUDA step's time is its kernels', not their launch)."""
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
