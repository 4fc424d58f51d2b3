"""Parameter-server placement: dense tensors spread by size onto the least-loaded server, tables sharded by row
id, the same map every time, and bad input refused by name."""

from __future__ import annotations

import pytest

from convoy.errors import ConfigError
from convoy.parallel.ps.placement import DenseSpec, Placement, TableSpec, place


def test_dense_tensors_go_largest_first_onto_the_least_loaded_server() -> None:
    dense = [DenseSpec("small", (10,)), DenseSpec("big", (100, 10)), DenseSpec("mid", (50, 10)),
             DenseSpec("mid2", (40, 10)), DenseSpec("bias", (3,))]
    placement = place(dense, [], 2)
    # big (1000) -> 0; mid (500) -> 1; mid2 (400) -> 1 (500 < 1000); small -> 1 (900 < 1000); bias -> 1 (910)
    assert placement.dense_owner == {"big": 0, "mid": 1, "mid2": 1, "small": 1, "bias": 1}
    assert placement.dense_on(0) == ["big"]
    assert placement.load(0) == 1000 and placement.load(1) == 913


def test_placement_is_deterministic_whatever_the_order_given() -> None:
    dense = [DenseSpec(f"t{i}", (i % 4 + 1, 7)) for i in range(12)]
    tables = [TableSpec("users", 101, 8)]
    first = place(dense, tables, 3)
    again = place(list(reversed(dense)), tables, 3)
    assert first.dense_owner == again.dense_owner
    assert Placement.from_dict(first.to_dict()) == first


def test_table_rows_are_sharded_by_id_and_counted_per_server() -> None:
    placement = place([], [TableSpec("items", 10, 4)], 3)
    assert [placement.rows_on("items", s) for s in range(3)] == [4, 3, 3]
    for row in range(10):
        server, local = placement.owner_of_rows(row), placement.local_rows(row)
        assert local < placement.rows_on("items", server)
        assert placement.global_rows(server, local) == row
    held = sorted(placement.global_rows(s, local) for s in range(3) for local in range(placement.rows_on("items", s)))
    assert held == list(range(10))


def test_tables_count_in_the_load_that_spreads_dense_tensors() -> None:
    placement = place([DenseSpec("w", (6,))], [TableSpec("t", 3, 2)], 2)  # rows: server 0 holds 2, server 1 holds 1
    assert placement.dense_owner == {"w": 1}
    assert placement.load(0) == 4 and placement.load(1) == 8


def test_bad_placements_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="at least 1 server"):
        place([DenseSpec("w", (2,))], [], 0)
    with pytest.raises(ConfigError, match=r"names \['w'\] are used twice"):
        place([DenseSpec("w", (2,))], [TableSpec("w", 4, 2)], 2)
    with pytest.raises(ConfigError, match="table 'e'.*num_rows >= 1"):
        place([], [TableSpec("e", 0, 2)], 2)
    with pytest.raises(ConfigError, match="no embedding table 'x'"):
        place([], [TableSpec("e", 4, 2)], 2).check_table("x")
