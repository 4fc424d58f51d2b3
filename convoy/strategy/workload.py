"""What a training script hands the strategy search, and a rank's memory as the kernel counts it.

A script planned by ``convoy plan`` defines ``workload() -> Workload``: how to build its model,
optimizer and batches. ``convoy plan`` imports the script (its ``__main__`` block does not run).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convoy.errors import ConfigError
from convoy.strategy.plan import fingerprint

MMAP_THRESHOLD = "65536"
"""Dry-run ranks start with ``MALLOC_MMAP_THRESHOLD_`` at this, so a freed tensor leaves the RSS at once."""


@dataclass
class Workload:
    """A training script's model, optimizer and data, as functions the search can call again."""

    model: Callable[[], nn.Module]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    batch: Callable[[int, int], tuple[Any, torch.Tensor]]
    """``(samples, seed) -> (inputs, targets)``."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int
    """Samples per rank per optimizer step."""


def load_workload(script: str | Path) -> Workload:
    """Import ``script`` and call its ``workload()``."""
    path = Path(script).resolve()
    if not path.is_file():
        raise ConfigError(f"training script {script} does not exist")
    spec = importlib.util.spec_from_file_location(f"convoy_planned_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    if not callable(getattr(module, "workload", None)):
        raise ConfigError(f"{script} has no workload() function; define one returning convoy.strategy.Workload "
                          "(model, optimizer, batch, loss, batch_size) so convoy plan can build the model")
    found = module.workload()
    if not isinstance(found, Workload):
        raise ConfigError(f"{script}'s workload() returned {type(found).__name__}, not convoy.strategy.Workload")
    if found.batch_size < 1:
        raise ConfigError(f"{script}'s workload() has batch_size {found.batch_size}; give samples per rank >= 1")
    return found


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks (the ``ModuleList`` holding the most parameters), as ``(name, module)``."""
    best: list[tuple[str, nn.Module]] = []
    best_size = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                prefix = f"{name}." if name else ""
                best, best_size = [(f"{prefix}{i}", block) for i, block in enumerate(module)], size
    return best


def model_identity(model: nn.Module) -> tuple[str, str]:
    """``(fingerprint, summary)`` of a model, the same before and after DDP/FSDP wrapping."""
    inner = getattr(model, "module", model)
    named = [(name, tuple(t.shape), str(t.dtype)) for name, t in [*inner.named_parameters(),
                                                                   *inner.named_buffers()]]
    count = sum(p.numel() for p in inner.parameters())
    return fingerprint(named), f"{type(inner).__name__} of {count / 1e6:.2f} M parameters"


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a (nested) value."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss() -> int:
    """This process's resident bytes now."""
    return _status_kb("VmRSS:") * 1024


def peak_rss() -> int:
    """The most resident bytes since the last ``reset_peak``."""
    return _status_kb("VmHWM:") * 1024


def _glibc() -> Any:
    """The C library where it is glibc (it has ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def release_free() -> None:
    """Hand the pages of the allocator's free chunks back to the kernel (glibc's ``malloc_trim``): a chunk freed
    inside malloc's heaps stays resident, and a later run that reuses it adds nothing to the RSS, so a run's peak
    would read what earlier runs happened to leave free (10-17% less for a small FSDP candidate run again, and a
    different amount from one run of the same order to the next). Nothing where the C library is not glibc."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def reset_peak() -> None:
    """Start a new high-water mark at the current RSS (Linux ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
