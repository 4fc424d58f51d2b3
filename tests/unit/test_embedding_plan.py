"""Sharded embeddings, the pure parts: row ranges, table placement, initial rows that do not
depend on the placement, and the errors for bad tables."""

from __future__ import annotations

import pytest
import torch

from convoy.errors import ConfigError
from convoy.parallel import even_bounds
from convoy.parallel.embedding.bags import TableSpec, init_rows, plan_tables


def test_even_bounds_cover_the_table_in_near_equal_ranges() -> None:
    assert even_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert even_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for rows, world in ((1_000_003, 7), (5, 1)):
        bounds = even_bounds(rows, world)
        assert bounds[0][0] == 0 and bounds[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1


def test_placement_row_wise_for_large_tables_table_wise_for_small_ones() -> None:
    specs = [TableSpec("big", 1_000_000, 64), TableSpec("a", 100, 64), TableSpec("b", 300, 64),
             TableSpec("c", 200, 64), TableSpec("forced", 8, 4, sharding="row")]
    plan = plan_tables(specs, 4)
    assert list(plan) == ["big", "a", "b", "c", "forced"]
    assert plan["big"].kind == "row" and [plan["big"].rows_on(r) for r in range(4)] == [250_000] * 4
    assert plan["forced"].kind == "row" and [plan["forced"].rows_on(r) for r in range(4)] == [2] * 4
    owners = {name: [r for r in range(4) if plan[name].rows_on(r)] for name in ("a", "b", "c")}
    for name in ("a", "b", "c"):  # a table-wise table's every id is its owner's
        assert plan[name].owners(torch.tensor([0, 99])).tolist() == owners[name] * 2
    assert owners == {"b": [0], "c": [1], "a": [2]}  # largest first, each to the least-loaded rank
    assert all(plan[name].rows_on(owners[name][0]) == spec.num_rows
               for name, spec in (("a", specs[1]), ("b", specs[2]), ("c", specs[3])))


def test_a_table_smaller_than_the_world() -> None:
    tiny = TableSpec("tiny", 3, 16, sharding="row")
    with pytest.raises(ConfigError, match="table 'tiny' has 3 rows but there are 4 ranks.*sharding='table'"):
        plan_tables([tiny], 4)
    assert plan_tables([TableSpec("tiny", 3, 16)], 4)["tiny"].kind == "table"  # auto places it whole


def test_bad_tables() -> None:
    with pytest.raises(ConfigError, match="num_rows >= 1 and dim >= 1"):
        TableSpec("t", 0, 8)
    with pytest.raises(ConfigError, match="unknown pooling 'max'"):
        TableSpec("t", 10, 8, pooling="max")
    with pytest.raises(ConfigError, match="unknown sharding 'column'"):
        TableSpec("t", 10, 8, sharding="column")
    with pytest.raises(ConfigError, match="names must be unique"):
        plan_tables([TableSpec("t", 10, 8), TableSpec("t", 20, 8)], 2)


def test_initial_rows_do_not_depend_on_the_placement() -> None:
    spec = TableSpec("t", 200_000, 4)
    whole = init_rows(spec, 3, 0, spec.num_rows)
    for start, end in ((0, 1), (65_535, 65_537), (123_456, 200_000)):
        assert torch.equal(init_rows(spec, 3, start, end), whole[start:end])
    assert whole.abs().max() <= 1 / spec.num_rows ** 0.5
    assert not torch.equal(init_rows(spec, 4, 0, 10), whole[:10])
    for first, stride in ((0, 4), (3, 4), (1, 7)):  # a row-wise rank's interleaved rows, across blocks
        assert torch.equal(init_rows(spec, 3, first, spec.num_rows, stride), whole[first::stride])


def test_row_wise_rows_are_interleaved_so_a_hot_head_of_low_ids_spreads_over_every_rank() -> None:
    place = plan_tables([TableSpec("t", 10, 4, sharding="row")], 4)["t"]
    ids = torch.arange(10)
    assert place.owners(ids).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert place.local(ids).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert [place.rows_on(r) for r in range(4)] == [3, 3, 2, 2]
    assert [place.span(r).rows().tolist() for r in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    skewed = (torch.rand(100_000, generator=torch.Generator().manual_seed(0)).pow(3) * 10_000_000).long()
    share = torch.bincount(place._replace(num_rows=10_000_000).owners(skewed), minlength=4) / len(skewed)
    assert share.max() < 0.26, share  # contiguous ranges gave rank 0 63% of these


def test_runs_split_sorted_keys_at_every_change_and_at_every_source() -> None:
    from convoy.parallel.embedding.bags import _runs

    # three sources: [3, 3, 5], [] (sent nothing), [5, 5, 9]; the 5s of two sources are two bags, two runs
    run, firsts, per_source = _runs(torch.tensor([3, 3, 5, 5, 5, 9]), [3, 0, 3])
    assert run.tolist() == [0, 0, 1, 2, 2, 3] and firsts.tolist() == [0, 2, 3, 5] and per_source == [2, 0, 2]
    run, firsts, per_source = _runs(torch.empty(0, dtype=torch.int64), [0, 0])
    assert run.tolist() == [] and firsts.tolist() == [] and per_source == [0, 0]
