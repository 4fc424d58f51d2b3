"""What an allreduce call may ask (``check_call``), and that every rank asks the same: a mismatch of size,
dtype, op or algorithm hangs or garbles the sum, so ``check_same_call`` finds one before any data moves
and names the ranks that differ."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from convoy.errors import ConfigError
from convoy.parallel.allreduce.host_memory import reduce_path
from convoy.parallel.topology import ALGORITHMS, CODED, Topology, check_algorithm, uncoded

OPS = ("sum", "avg")
CHOICES = (*ALGORITHMS, "auto")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)


def check_call(tensor: torch.Tensor, op: str, algorithm: str, topology: Topology) -> str:
    """Refuse what can't be reduced; return how the in-group phases move it (``reduce_path``)."""
    if op not in OPS:
        raise ConfigError(f"unknown reduce op {op!r}; choose from {', '.join(OPS)}")
    check_algorithm(algorithm)
    path = reduce_path(dist.get_backend(), tensor.device.type)
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ConfigError(f"op 'avg' needs a floating-point or complex tensor, not {tensor.dtype}; "
                          "use op 'sum' and divide")
    if algorithm in CODED and len(topology.groups) != 2:
        raise ConfigError(f"algorithm {algorithm!r} codes what two groups exchange; this topology has "
                          f"{len(topology.groups)} group(s): use {uncoded(algorithm)!r} or 'auto'")
    if uncoded(algorithm) == "reduce_scatter" and not topology.is_uniform:
        topology.shard_groups()  # raises the reason
    return path


def describe_call(tensor: torch.Tensor, op: str, algorithm: str) -> list[int]:
    """One rank's call as four numbers (elements, dtype, op, algorithm) that the ranks can gather."""
    dtype = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else len(DTYPES)
    return [tensor.numel(), dtype, OPS.index(op), CHOICES.index(algorithm)]


def mismatch(rows: list[list[int]]) -> str | None:
    """What differs between the ranks' calls (``describe_call`` of each rank, in rank order), or None."""
    differ = [rank for rank, row in enumerate(rows) if row != rows[0]]
    if not differ:
        return None
    described = [f"rank {r}: {row[0]} elements of {_dtype_name(row[1])}, op {OPS[row[2]]}, "
                 f"algorithm {CHOICES[row[3]]}" for r, row in enumerate(rows) if r == 0 or r in differ][:4]
    return ("allreduce called with different tensors or settings on different ranks (" + "; ".join(described)
            + "); every rank must pass the same size, dtype, op and algorithm")


def check_same_call(group: Any, world_size: int, tensor: torch.Tensor, op: str, algorithm: str) -> None:
    """Raise ``ConfigError`` on every rank of ``group`` if their calls differ (collective: one small all-gather)."""
    mine = torch.tensor(describe_call(tensor, op, algorithm), device=tensor.device)
    every = torch.empty(world_size * 4, dtype=torch.int64, device=tensor.device)
    dist.all_gather_single(every, mine, group=group)
    problem = mismatch(every.view(world_size, 4).tolist())
    if problem is not None:
        raise ConfigError(problem)


def _dtype_name(index: int) -> str:
    return str(DTYPES[index]).removeprefix("torch.") if index < len(DTYPES) else "another dtype"
