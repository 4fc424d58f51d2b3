"""A persistent checkpoint restores in a world of another size (real gloo ranks, no in-memory snapshots):
model and optimizer as saved on every rank, each saved rank's data position on the same rank, fresh
data positions on new ranks, and model_state from a saved peer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import FIXTURES, ProcessScope

pytestmark = pytest.mark.slow
SCRIPT = str(FIXTURES / "ckpt_resize.py")
STEPS = 6  # persisted after steps 2 and 5


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _check_restored(out: Path, saved_world: int, world: int, logs: list[str]) -> None:
    saved = [torch.load(out / f"train-rank{rank}.pt") for rank in range(saved_world)]
    for rank in range(world):
        restored = torch.load(out / f"restore-rank{rank}.pt")
        assert restored["start"] == STEPS
        for key in ("model", "optim", "sched"):
            assert _same(restored[key], saved[0][key]), f"rank {rank}: {key} differs from what was saved"
        fresh = torch.Generator().manual_seed(100 + rank).get_state()
        expected = saved[rank]["data"] if rank < saved_world else fresh
        assert torch.equal(restored["data"], expected), f"rank {rank}: data position"
    assert f"resumed from persistent checkpoint" in logs[0] and f"(step {STEPS - 1})" in logs[0], logs[0]
    assert f"saved by ranks {list(range(saved_world))}, restored on {world}" in logs[0], logs[0]


def _stderr(procs: ProcessScope, count: int) -> list[str]:
    return [launched.stderr() for launched in procs.launched[-count:]]


def test_checkpoint_of_one_rank_restores_on_two_and_on_four(procs: ProcessScope, tmp_path: Path) -> None:
    procs.gloo_ranks(SCRIPT, 1, ["train", STEPS, tmp_path])
    for world in (2, 4):
        procs.gloo_ranks(SCRIPT, world, ["restore", STEPS, tmp_path])
        logs = _stderr(procs, world)
        _check_restored(tmp_path, 1, world, logs)
        assert f"ranks {list(range(1, world))} have no saved data position or RNG" in logs[0], logs[0]


def test_checkpoint_of_four_ranks_restores_on_two(procs: ProcessScope, tmp_path: Path) -> None:
    procs.gloo_ranks(SCRIPT, 4, ["train", STEPS, tmp_path])
    procs.gloo_ranks(SCRIPT, 2, ["restore", STEPS, tmp_path])
    logs = _stderr(procs, 2)
    _check_restored(tmp_path, 4, 2, logs)
    assert "the data position and RNG saved by ranks [2, 3] are not used" in logs[0], logs[0]
