"""Where an embedding table's rows live, and their initial values: pure functions of the tables and the world size.

Row-wise tables are interleaved: row ``i`` lives on rank ``i % world`` as its ``i // world``-th local row. Ids in
recommendation data are often numbered by frequency (the vocabulary sorted by count), so contiguous ranges would
put the hot head of every table on rank 0; interleaving spreads it over every rank (a 4-rank job of power-law ids,
``benchmarks/embedding.py``: rank 0 received 63% of all lookups with ranges). Table-wise tables (small ones) sit
whole on one rank. A rank's rows are ``first + stride * k`` for ``k < count`` either way (``Placement.span``),
which is also what ``store.py`` writes beside them, so any placement reads any other's files.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from convoy.errors import ConfigError

POOLINGS = ("sum", "mean")
SHARDINGS = ("auto", "row", "table")
TABLE_WISE_BELOW = 1 << 16
"""``auto`` places a table whole on one rank when it has fewer rows x dim than this."""
INIT_CLASSES, INIT_CLASS_BLOCK = 256, 4096
"""Initial rows are drawn per class of rows ``i % INIT_CLASSES`` (a world that divides it draws only its own rows), in
blocks of ``INIT_CLASS_BLOCK`` rows of a class (a contiguous range draws only the blocks around it)."""


@dataclass(frozen=True)
class TableSpec:
    name: str
    num_rows: int
    dim: int
    pooling: str = "sum"
    sharding: str = "auto"

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("an embedding table needs a name")
        if self.num_rows < 1 or self.dim < 1:
            raise ConfigError(f"table {self.name!r} needs num_rows >= 1 and dim >= 1 "
                              f"(got {self.num_rows} x {self.dim})")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"table {self.name!r}: unknown pooling {self.pooling!r}; choose from {POOLINGS}")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"table {self.name!r}: unknown sharding {self.sharding!r}; choose from {SHARDINGS}")


class Span(NamedTuple):
    """A rank's rows of a table: ``first + stride * k`` for ``k < count``."""

    first: int
    stride: int
    count: int

    def rows(self) -> torch.Tensor:
        return torch.arange(self.count, dtype=torch.int64) * self.stride + self.first


class Placement(NamedTuple):
    """``row``: row ``i`` on rank ``i % world``; ``table``: every row on rank ``owner``."""

    kind: str
    num_rows: int
    world: int
    owner: int = -1

    def span(self, rank: int) -> Span:
        if self.kind == "row":
            return Span(rank, self.world, len(range(rank, self.num_rows, self.world)))
        return Span(0, 1, self.num_rows if rank == self.owner else 0)

    def rows_on(self, rank: int) -> int:
        return self.span(rank).count

    def owners(self, ids: torch.Tensor) -> torch.Tensor:
        """The rank holding each id's row."""
        return ids % self.world if self.kind == "row" else torch.full_like(ids, self.owner)

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's index among its owner's rows."""
        return ids // self.world if self.kind == "row" else ids


def plan_tables(specs: Sequence[TableSpec], world: int) -> dict[str, Placement]:
    """Row-wise tables span all ranks; table-wise ones go, largest first, to the rank holding the
    fewest table-wise rows x dim so far."""
    if world < 1:
        raise ConfigError(f"world size must be >= 1 (got {world})")
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"embedding table names must be unique (got {names})")
    plan: dict[str, Placement] = {}
    load = [0] * world
    table_wise = []
    for spec in specs:
        kind = spec.sharding
        if kind == "auto":
            kind = "table" if spec.num_rows * spec.dim < TABLE_WISE_BELOW or spec.num_rows < world else "row"
        if kind == "row":
            if spec.num_rows < world:
                raise ConfigError(f"table {spec.name!r} has {spec.num_rows} rows but there are {world} ranks: "
                                  "row-wise sharding needs a row per rank; use sharding='table' or 'auto'")
            plan[spec.name] = Placement("row", spec.num_rows, world)
        else:
            table_wise.append(spec)
    for spec in sorted(table_wise, key=lambda s: -s.num_rows * s.dim):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += spec.num_rows * spec.dim
        plan[spec.name] = Placement("table", spec.num_rows, world, owner)
    return {name: plan[name] for name in names}


def init_rows(spec: TableSpec, seed: int, start: int, end: int, stride: int = 1) -> torch.Tensor:
    """Rows ``start, start + stride, ...`` below ``end`` of the table's initial weights: uniform in +-1/sqrt(num_rows)
    (as DLRM), the same under any placement. Row ``i`` is drawn in its class ``i % INIT_CLASSES``, in fixed blocks
    of that class's rows, so a rank of interleaved rows (``stride`` a divisor of ``INIT_CLASSES``) draws only its
    own rows, and a contiguous range only the blocks around it."""
    bound = 1.0 / math.sqrt(spec.num_rows)
    count = len(range(start, max(start, end), stride))
    out = torch.empty(count, spec.dim)
    if not count:
        return out
    period = INIT_CLASSES // math.gcd(stride, INIT_CLASSES)  # wanted rows of one class: every period-th
    for first in range(min(period, count)):
        row = start + stride * first
        positions = torch.arange(first, count, period)
        within = (start + stride * positions) // INIT_CLASSES  # each wanted row's place in its class (ascending)
        out[positions] = _class_rows(spec, seed, row % INIT_CLASSES, within).mul_(2 * bound).sub_(bound)
    return out


def _class_rows(spec: TableSpec, seed: int, klass: int, within: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) values of the rows at ``within`` (ascending) of class ``klass``, drawn block by block."""
    values = torch.empty(len(within), spec.dim)
    first_block, last_block = int(within[0]) // INIT_CLASS_BLOCK, int(within[-1]) // INIT_CLASS_BLOCK
    edges = torch.searchsorted(within, torch.arange(first_block, last_block + 2) * INIT_CLASS_BLOCK).tolist()
    class_rows = len(range(klass, spec.num_rows, INIT_CLASSES))
    for block, (a, b) in enumerate(zip(edges, edges[1:], strict=False), start=first_block):
        if a == b:
            continue
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{spec.name}/{klass}/{block}".encode()))
        drawn = torch.rand(min(INIT_CLASS_BLOCK, class_rows - block * INIT_CLASS_BLOCK), spec.dim, generator=gen)
        lo, hi = int(within[a]) - block * INIT_CLASS_BLOCK, int(within[b - 1]) - block * INIT_CLASS_BLOCK + 1
        values[a:b] = drawn[lo:hi] if hi - lo == b - a else drawn[within[a:b] - block * INIT_CLASS_BLOCK]
    return values
