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


def balanced_bounds(weights: list[float] | tuple[float, ...], parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``parts`` contiguous non-empty pieces of ``weights`` whose heaviest piece is as light as
    can be, the earlier cut on ties (layers over pipeline stages by their compute)."""
    n = len(weights)
    if parts < 1 or parts > n:
        raise ValueError(f"cannot cut {n} items into {parts} non-empty pieces; use between 1 and {n}")
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    # best[k][i]: the lightest heaviest piece cutting the first i items into k pieces; cut[k][i]: its last start
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, end = [], n
    for k in range(parts, 0, -1):
        bounds.append((cut[k][end], end))
        end = cut[k][end]
    return bounds[::-1]
