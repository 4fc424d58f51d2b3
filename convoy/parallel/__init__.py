"""The data plane, one subpackage per parallelism: allreduce/, pipeline/, tensor/, sequence/, embedding/;
beside them topology.py (groups of ranks and link costs, shared by all) and local_sgd.py."""

from __future__ import annotations


def even_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``parts`` contiguous pieces of ``total`` items, the first ``total % parts``
    one longer (rows of a table over ranks, layers over stages, positions over micro-sequences)."""
    base, extra = divmod(total, parts)
    bounds, at = [], 0
    for index in range(parts):
        size = base + (index < extra)
        bounds.append((at, at + size))
        at += size
    return bounds
