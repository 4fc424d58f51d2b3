"""A model's two hooks for sequence parallelism from outside: ``convoy.attention`` and ``convoy.positions``.

A model that computes its attention with ``attention(q, k, v, causal=...)`` and its position indices with
``positions(length)`` runs unchanged on one rank (torch's ``scaled_dot_product_attention``, positions from 0)
and, inside ``sharded(group)``, on a part of each sequence: the rank of ``group`` holds positions
``[rank l, (rank + 1) l)`` of every sample, its attention runs by query broadcast over the group
(``query_broadcast.py``), and its positions start where its part does. The strategy search sees the hooks called
when it traces the model (``recording``): that is what makes sequence parallelism a candidate for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _Shard:
    group: Any
    rank: int
    world: int


@dataclass
class Record:
    """What the hooks saw while ``recording()``: each attention call's queries' shape and causality, and how many
    times positions were asked for."""

    attention: list[tuple[tuple[int, ...], bool]] = field(default_factory=list)
    positions: int = 0


_CURRENT: list[_Shard] = []
_RECORDS: list[Record] = []


@contextlib.contextmanager
def sharded(group: Any) -> Iterator[None]:
    """Within: the hooks act on this rank's part of the sequence, split over ``group``'s ranks in their order."""
    _CURRENT.append(_Shard(group, dist.get_rank(group), dist.get_world_size(group)))
    try:
        yield
    finally:
        _CURRENT.pop()


@contextlib.contextmanager
def recording() -> Iterator[Record]:
    """Within: the hooks' calls are written down in the ``Record`` yielded."""
    _RECORDS.append(Record())
    try:
        yield _RECORDS[-1]
    finally:
        _RECORDS.pop()


def current() -> _Shard | None:
    return _CURRENT[-1] if _CURRENT else None


def positions(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The positions of this rank's ``length`` tokens: ``0..length-1``, or its part's when sharded."""
    if _RECORDS:
        _RECORDS[-1].positions += 1
    shard = current()
    start = 0 if shard is None else shard.rank * length
    return torch.arange(start, start + length, device=device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Exact softmax attention, ``(batch, heads, positions, head_dim)`` in and out; over the whole sequence when
    sharded (each rank passes its part's queries, keys and values; computed and sent in float32)."""
    if _RECORDS:
        _RECORDS[-1].attention.append((tuple(q.shape), causal))
    shard = current()
    if shard is None or shard.world == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    from convoy.parallel.sequence.query_broadcast import query_broadcast_attention

    # in float32 whatever autocast made q, k and v: the fused CPU kernels query broadcast runs take no bfloat16
    with torch.autocast("cpu", enabled=False):
        out = query_broadcast_attention(q.float(), k.float(), v.float(), shard.group, causal)
    return out.to(q.dtype)
