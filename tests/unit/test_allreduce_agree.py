"""The pure half of the same-call check: how a rank's call is described and what a mismatch says."""

from __future__ import annotations

import torch

from convoy.parallel.allreduce.agree import describe_call, mismatch


def test_the_same_call_on_every_rank_is_no_mismatch() -> None:
    row = describe_call(torch.zeros(10), "sum", "auto")
    assert mismatch([row, list(row), list(row)]) is None


def test_a_mismatch_names_rank_0_and_each_rank_that_differs() -> None:
    same = describe_call(torch.zeros(10), "sum", "auto")
    rows = [same, same, describe_call(torch.zeros(12, dtype=torch.float64), "avg", "leader"), same]
    problem = mismatch(rows)
    assert problem is not None
    assert "rank 0: 10 elements of float32, op sum, algorithm auto" in problem
    assert "rank 2: 12 elements of float64, op avg, algorithm leader" in problem
    assert "rank 1" not in problem and "rank 3" not in problem


def test_a_dtype_outside_the_list_is_described_not_refused() -> None:
    odd = describe_call(torch.zeros(3, dtype=torch.uint16), "sum", "auto")
    problem = mismatch([describe_call(torch.zeros(3), "sum", "auto"), odd])
    assert problem is not None and "3 elements of another dtype" in problem
