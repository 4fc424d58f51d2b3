"""Replicated (DDP) state across two real gloo ranks: a rank whose background copy of the last
finished step never landed resumes that step exactly, taking parameters and optimizer state from
a peer and its own data position from its partial snapshot."""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helpers import FIXTURES, ProcessScope
from convoy.runtime.slots import _HEADER, _SLOT, HEADER_SIZE, TensorRef, map_leaves
from convoy.shm import remove_segments, segment_path

pytestmark = pytest.mark.slow
SCRIPT = str(FIXTURES / "peer_restore.py")


@pytest.fixture
def job_id() -> Iterator[str]:
    job = f"peers{uuid.uuid4().hex[:8]}"
    yield job
    remove_segments(job)
    remove_segments(f"{job}ref")  # the reference run's job


def _run(procs: ProcessScope, job_id: str, start: int, stop: int, out: Path) -> list[str]:
    return procs.gloo_ranks(SCRIPT, 2, [start, stop, out], env={
        "CONVOY_JOB_ID": job_id, "CONVOY_NODE_ID": "n0", "CONVOY_RUN_DIR": str(out.parent)})


def _unfinish_newest(path: Path) -> int:
    """Make the newest slot look as if the worker died before its background copy landed: partial,
    with every pending tensor's bytes overwritten. Returns that slot's step."""
    with open(path, "r+b") as segment:
        raw = bytearray(segment.read())
    _, slot_size = _HEADER.unpack_from(raw, 0)
    slots = [_SLOT.unpack_from(raw, _HEADER.size + i * _SLOT.size) for i in range(2)]
    index = max(range(2), key=lambda i: slots[i][0])
    seq, step, data_len, meta_len, _, crc = slots[index]
    base = HEADER_SIZE + index * slot_size
    skeleton = pickle.loads(bytes(raw[base + data_len : base + data_len + meta_len]))
    pending: list[TensorRef] = []
    map_leaves(skeleton, TensorRef, lambda ref: pending.append(ref) if ref.pending else None)
    assert pending, "the snapshot copied nothing in the background"
    for ref in pending:
        raw[base + ref.offset : base + ref.offset + ref.nbytes] = b"\xff" * ref.nbytes
    _SLOT.pack_into(raw, _HEADER.size + index * _SLOT.size, seq, step, data_len, meta_len, 0, crc)
    path.write_bytes(raw)
    return step


def test_rank_with_unfinished_copy_resumes_its_finished_step_from_a_peer(procs: ProcessScope, job_id: str,
                                                                          tmp_path: Path) -> None:
    _run(procs, f"{job_id}ref", 0, 10, tmp_path / "reference.pt")
    _run(procs, job_id, 0, 6, tmp_path / "first.pt")
    assert _unfinish_newest(segment_path(job_id, "n0-local1")) == 5
    outputs = _run(procs, job_id, 6, 10, tmp_path / "resumed.pt")
    assert "rank 0: in-memory snapshot of step 5 (own)" in outputs[0]
    assert "rank 1: in-memory snapshot of step 5 (rank 0's with its own data position)" in outputs[1]
    reference, resumed = torch.load(tmp_path / "reference.pt"), torch.load(tmp_path / "resumed.pt")
    for name, value in reference.items():
        assert torch.equal(value, resumed[name]), name


def test_ranks_sharing_no_step_resume_after_the_newest_one_any_rank_holds(procs: ProcessScope, job_id: str,
                                                                          tmp_path: Path) -> None:
    """Rank 1's node was out of the job while rank 0 trained on alone: rank 1 holds only old steps.
    Without replicated state the job resumes at the step rank 0 reached, each rank from its own newest."""
    script, out = str(FIXTURES / "ckpt_apart.py"), tmp_path / "apart"
    env = {"CONVOY_JOB_ID": job_id, "CONVOY_NODE_ID": "n0", "CONVOY_RUN_DIR": str(tmp_path)}
    procs.gloo_ranks(script, 2, [0, 5, f"{out}.a"], env=env)  # both ranks hold steps 3 and 4
    procs.gloo_ranks(script, 1, [5, 10, f"{out}.b"], env=env)  # rank 0 alone reaches step 9
    outputs = procs.gloo_ranks(script, 2, [10, 12, f"{out}.c"], env=env)
    errors = procs.launched[-2].stderr()
    assert "the job resumes at step 10" in errors and "rank 0 from step 9, rank 1 from step 4" in errors, errors
    assert "resumed_apart" in errors
    assert "rank 1: in-memory snapshot of step 4 (own; the job resumes after step 9)" in outputs[1]
    for rank, before in ((0, "b"), (1, "a")):
        restored = torch.load(f"{out}.c.rank{rank}.restored.pt")
        saved = torch.load(f"{out}.{before}.rank{rank}.final.pt")
        for name, value in saved.items():
            assert torch.equal(value, restored[name]), (rank, name)
