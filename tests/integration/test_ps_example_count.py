"""The parameter-server example's exactly-once count (what the PS fault benchmarks read): it says "each batch applied
once on each server" only when every server holds each batch's tag and applied no push beyond them, so a batch
applied twice (a server's version past its tags) is counted, not hidden."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from helpers import REPO

from convoy.parallel.ps.client import Tally


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_ps_example", REPO / "examples" / "train_ps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_batch_once_on_each_server_is_said_so() -> None:
    line = example().exactly_once([Tally([0, 1, 2], 1, 3), Tally([0, 1, 2], 0, 3)], 3)
    assert line == "exactly once: each of the 3 batches applied once on each of 2 servers (1 repeated pushes skipped)"


def test_a_server_that_applied_more_pushes_than_it_holds_batches_is_not_exactly_once() -> None:
    line = example().exactly_once([Tally([0, 1, 2], 0, 3), Tally([0, 1, 2], 0, 5)], 3)
    assert line == ("batches NOT trained exactly once: server 1 lacks 0 batches [] and holds 0 outside the epoch [] "
                    "and applied 2 pushes beyond one per batch it holds")


def test_a_missing_batch_is_counted() -> None:
    line = example().exactly_once([Tally([0, 2], 0, 2), Tally([0, 1, 2], 0, 3)], 3)
    assert line == ("batches NOT trained exactly once: server 0 lacks 1 batches [1] and holds 0 outside the epoch [] "
                    "and applied 0 pushes beyond one per batch it holds")
