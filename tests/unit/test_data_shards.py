"""convoy.shards() outside convoy (no agent): the whole dataset in-process, the declaration checked, progress
and done reported as batches are trained, and a shard taken back ends its batches."""

from __future__ import annotations

import subprocess
import sys

import pytest

import convoy
from convoy.control.protocol import shards as sp
from convoy.errors import ConfigError
from convoy.worker.shards import shards

ALONE: dict[str, str] = {}
"""No CONVOY_AGENT_URL: the in-process queue."""


def test_alone_a_script_trains_every_item_of_every_epoch_once() -> None:
    stream = shards("train", num_samples=23, shard_size=5, epochs=2, shuffle_seed=7, env=ALONE)
    assert stream.first and stream.declared_by == "default:0:0"
    epochs: dict[int, list[int]] = {}
    for shard in stream:
        for batch in shard.batches(2):
            epochs.setdefault(shard.epoch, []).extend(batch)
    assert sorted(epochs) == [0, 1] and all(sorted(items) == list(range(23)) for items in epochs.values())
    assert epochs[0] != epochs[1], "each epoch's shard order is shuffled with its own seed"


def test_files_and_seeds_are_handed_out_as_themselves() -> None:
    files = [f"part-{i}.parquet" for i in range(5)]
    assert [shard.items for shard in shards("f", files=files, num_shards=2, env=ALONE)] == [files[:3], files[3:]]
    seeds = [item for shard in shards("s", num_seeds=4, first_seed=1000, shard_size=3, env=ALONE)
             for item in shard.items]
    assert seeds == [1000, 1001, 1002, 1003]


@pytest.mark.parametrize("kwargs, words", [
    ({"shard_size": 2}, "exactly one of num_samples, files or num_seeds"),
    ({"num_samples": 4, "num_seeds": 4, "shard_size": 2}, "exactly one of num_samples, files or num_seeds"),
    ({"num_samples": 4}, "exactly one of shard_size"),
    ({"num_samples": 4, "shard_size": 0}, "1 or more items per shard"),
    ({"num_samples": 4, "num_shards": 5}, "into 1 to 4 shards"),
    ({"num_samples": 0, "num_shards": 1}, "empty"),
    ({"num_samples": 4, "num_shards": 2, "epochs": 0}, "at least 1 epoch"),
])
def test_bad_declarations_say_what_to_give(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        shards("train", env=ALONE, **kwargs)  # type: ignore[arg-type]


def test_progress_counts_and_a_shard_taken_back_ends_its_batches() -> None:
    stream = shards("train", num_samples=10, num_shards=2, env=ALONE)
    shard = next(iter(stream))
    queue = stream.backend.master.queues["train"].queue  # type: ignore[attr-defined]
    batches = shard.batches(2)
    assert next(batches) == [0, 1]
    assert next(batches) == [2, 3] and queue.held["default:0:0"].shard.start == 2, "the first batch was reported"
    with pytest.raises(ConfigError, match="progress of 6 items on a shard of 5"):
        shard.progress(6)
    queue.worker_lost("default:0:0")  # as the master does when it takes the process for lost
    assert list(batches) == [] and shard.lost, "the next report is refused: the batches stop"
    assert shard.done() is False and not shard.finished


def test_the_shard_calls_validate_their_bounds() -> None:
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        sp.ShardProgress(name="t", role="worker", rank=0, incarnation=0, grant_id=0, trained_through=-1)


def test_convoy_shards_is_public_and_imports_no_torch() -> None:
    assert convoy.shards is shards
    code = "import sys, convoy; convoy.shards('t', num_samples=3, num_shards=1); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={
        "PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.strip() == "False"
