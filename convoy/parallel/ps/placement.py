"""Which parameter server holds what: dense tensors whole, spread by size (largest first onto the least-loaded
server), and embedding tables sharded by row id (row ``r`` lives on server ``r % num_servers`` as local row
``r // num_servers``), so every table's rows and traffic spread evenly. Pure: the same inputs give the same map
on every process, and the row formulas work on ints and on integer tensors alike."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from convoy.errors import ConfigError


@dataclass(frozen=True)
class DenseSpec:
    """A dense parameter as the servers see it."""

    name: str
    """Unique among the dense tensors and tables (e.g. ``mlp.0.weight``)."""
    shape: tuple[int, ...]
    """Its shape; the server holds exactly this."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class TableSpec:
    """An embedding table, sharded by row id over all servers."""

    name: str
    """Unique among the dense tensors and tables."""
    num_rows: int
    """Rows in the whole table (ids run 0 .. num_rows-1)."""
    dim: int
    """Width of one row."""


@dataclass(frozen=True)
class Placement:
    """The map from parameters to servers, made by ``place``."""

    num_servers: int
    dense: dict[str, DenseSpec]
    tables: dict[str, TableSpec]
    dense_owner: dict[str, int] = field(default_factory=dict)
    """Dense tensor name -> index of the server that holds it whole."""

    def dense_on(self, server: int) -> list[str]:
        """Names of the dense tensors ``server`` holds, in a fixed order."""
        return sorted(name for name, owner in self.dense_owner.items() if owner == server)

    def owner_of_rows(self, ids: Any) -> Any:
        """The server holding each row id (an int or an integer tensor)."""
        return ids % self.num_servers

    def local_rows(self, ids: Any) -> Any:
        """Each row id's index inside its server's shard."""
        return ids // self.num_servers

    def global_rows(self, server: int, local: Any) -> Any:
        """The table row ids of ``server``'s local rows."""
        return local * self.num_servers + server

    def rows_on(self, table: str, server: int) -> int:
        """How many rows of ``table`` ``server`` holds."""
        num_rows = self.tables[table].num_rows
        return max(0, (num_rows - server + self.num_servers - 1) // self.num_servers)

    def load(self, server: int) -> int:
        """Elements ``server`` holds (its dense tensors plus its rows of every table)."""
        dense = sum(self.dense[name].numel for name in self.dense_on(server))
        return dense + sum(self.rows_on(name, server) * spec.dim for name, spec in self.tables.items())

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready), for the message that sets a server up."""
        return {"num_servers": self.num_servers,
                "dense": [[spec.name, list(spec.shape), self.dense_owner[spec.name]] for spec in self.dense.values()],
                "tables": [[spec.name, spec.num_rows, spec.dim] for spec in self.tables.values()]}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Placement:
        dense = {name: DenseSpec(name, tuple(shape)) for name, shape, _ in data["dense"]}
        tables = {name: TableSpec(name, rows, dim) for name, rows, dim in data["tables"]}
        return Placement(int(data["num_servers"]), dense, tables, {name: owner for name, _, owner in data["dense"]})

    def check_table(self, table: str) -> TableSpec:
        if table not in self.tables:
            raise ConfigError(f"no embedding table {table!r} on the parameter servers (tables: "
                              f"{sorted(self.tables)}); declare it in place(..., tables=...)")
        return self.tables[table]


def place(dense: Sequence[DenseSpec], tables: Sequence[TableSpec], num_servers: int) -> Placement:
    """Spread ``dense`` over ``num_servers`` (largest first, each onto the server holding the fewest elements so
    far, ties to the lower index) and shard every table by row id. Deterministic."""
    if num_servers < 1:
        raise ConfigError(f"parameter servers: need at least 1 server (got {num_servers})")
    names = [spec.name for spec in dense] + [spec.name for spec in tables]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"parameter servers: names {duplicates} are used twice; give every dense tensor and "
                          f"table its own name")
    for spec in tables:
        if spec.num_rows < 1 or spec.dim < 1:
            raise ConfigError(f"table {spec.name!r}: needs num_rows >= 1 and dim >= 1 (got {spec.num_rows} rows "
                              f"of width {spec.dim})")
    for spec in dense:
        if any(size < 0 for size in spec.shape):
            raise ConfigError(f"dense tensor {spec.name!r}: negative size in shape {spec.shape}")
    table_specs = {spec.name: spec for spec in tables}
    # Tables load every server alike; start the count there so dense tensors even out the totals.
    loads = [sum(max(0, (t.num_rows - s + num_servers - 1) // num_servers) * t.dim for t in tables)
             for s in range(num_servers)]
    owner: dict[str, int] = {}
    for spec in sorted(dense, key=lambda spec: (-spec.numel, spec.name)):
        target = min(range(num_servers), key=lambda server: (loads[server], server))
        owner[spec.name] = target
        loads[target] += spec.numel
    return Placement(num_servers, {spec.name: spec for spec in dense}, table_specs, owner)
