"""The weight board: a version published by the trainer is copied by a rollout bit for bit (digests agree), only
newer versions are copied, a model that does not match is refused naming the parameter, and a reader never keeps a
torn version while another process publishes version after version into the same two slots."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from convoy.errors import ConfigError
from convoy.shm import SHM_DIR
from convoy.workloads.rlhf.buckets import Manifest
from convoy.workloads.rlhf.weight_board import WeightBoard


def model(fill: float | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    named = {"embed": torch.randn(300, 64, generator=gen), "norm": torch.randn(64, generator=gen).to(torch.bfloat16),
             **{f"block{i}.w": torch.randn(64, 64, generator=gen) for i in range(8)}}
    if fill is not None:
        for tensor in named.values():
            tensor.fill_(fill)
    return named


@pytest.fixture
def path() -> Iterator[Path]:
    where = SHM_DIR / f"convoy-test{uuid.uuid4().hex[:8]}-weights"
    yield where
    where.unlink(missing_ok=True)


def test_a_published_version_is_copied_bit_for_bit_and_only_newer_ones_are(path: Path) -> None:
    trainer = model(seed=1)
    board = WeightBoard.create(path, Manifest.of(trainer, bucket_bytes=32 << 10))
    rollout = WeightBoard.open(path)
    shadow = model(seed=2)
    assert rollout.read_into(shadow, have=0) is None, "nothing published yet"
    sent = board.publish(1, trainer)
    assert sent == board.digest_of(trainer), "the digest of what it wrote is the trainer's weights' own"
    assert rollout.read_into(shadow, have=0) == 1
    assert all(torch.equal(shadow[name], t) for name, t in trainer.items())
    assert rollout.digest_of(shadow) == sent == rollout.current()[1] == rollout.read_digest
    assert rollout.read_into(shadow, have=1) is None
    trainer["block3.w"][0, 0] += 1
    second = board.publish(2, trainer)
    assert rollout.current() == (2, second) and second != sent
    assert rollout.read_into(shadow, have=1) == 2 and torch.equal(shadow["block3.w"], trainer["block3.w"])
    assert rollout.digest_of(shadow) == rollout.read_digest == second
    with pytest.raises(ConfigError, match="not newer"):
        board.publish(2, trainer)
    rollout.close()
    board.remove()
    assert not path.exists()


def test_a_rollout_model_that_does_not_match_is_refused_by_name(path: Path) -> None:
    board = WeightBoard.create(path, Manifest.of(model()))
    board.publish(1, model())
    shadow = model()
    shadow["block2.w"] = torch.zeros(64, 32)
    with pytest.raises(ConfigError, match="parameter 'block2.w' is sent as torch.float32 \\[64, 64\\]"):
        WeightBoard.open(path).read_into(shadow, have=0)
    board.remove()


def test_a_file_that_is_not_a_board_is_refused(path: Path) -> None:
    path.write_bytes(b"x" * 8192)
    with pytest.raises(ConfigError, match="is not a weight board"):
        WeightBoard.open(path)


WRITER = """
import sys, torch
from pathlib import Path
from convoy.workloads.rlhf.weight_board import WeightBoard
sys.path.insert(0, sys.argv[2])
from test_rlhf_weight_board import model
board = WeightBoard.open(Path(sys.argv[1]))
for version in range(2, 400):
    board.publish(version, model(fill=float(version)))
print("done", flush=True)
"""


def test_a_reader_never_keeps_a_torn_version_while_another_process_publishes(path: Path) -> None:
    board = WeightBoard.create(path, Manifest.of(model(), bucket_bytes=64 << 10))
    board.publish(1, model(fill=1.0))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(Path(__file__).parent)],
                              stdout=subprocess.PIPE, text=True)
    shadow, have, reads = model(), 0, 0
    deadline = time.monotonic() + 60
    try:
        while have < 399:
            assert writer.poll() in (None, 0) and time.monotonic() < deadline, "the writer failed or hung"
            got = board.read_into(shadow, have)
            if got is None:
                continue
            reads += 1
            for name, tensor in shadow.items():
                assert bool((tensor == got).all()), f"version {got} torn in {name}"
            assert board.read_digest == board.digest_of(shadow), f"version {got}'s digest is not its own"
            have = got
        assert writer.wait(60) == 0 and have == 399 and reads > 1
    finally:
        writer.kill()
        board.remove()
