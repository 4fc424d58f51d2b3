"""A Lightning Trainer with ConvoyCallback under convoy (two ranks, strategy="ddp" on gloo, gradients accumulated
over 2 batches): rank 1 SIGKILLed at the first epoch's end, then rank 0 mid-way through the third epoch, the job
goes on each time in a new round from the newest snapshot, no optimizer step is run twice and the final weights
are bit-identical to an uninterrupted run, also where the data is drawn from the global RNG in
``LightningDataModule.setup()`` and ``train_dataloader()``; outside convoy the callback changes nothing."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import ProcessScope, fixture

from convoy.shm import SHM_DIR

pytestmark = pytest.mark.slow
STEPS = 36  # 96 samples, 2 ranks x batch 2: 24 batches an epoch on each rank, 12 optimizer steps; 3 epochs
KILLS = ((1, 12), (0, 29))  # attempt 0: as step 13 begins (an epoch's end); attempt 1: 10 batches into epoch 3
BORING_STEPS = 80  # BoringModel: each rank shuffles all 64 samples, batch 1: 64 steps an epoch
BORING_KILLS = ((1, 25), (0, 64), (1, 72))  # 25 batches into the first epoch; at its end; 8 into the next one


def _train(procs: ProcessScope, tmp_path: Path, name: str, *extra: object, script: str = "lightning_train.py",
           steps: int = STEPS) -> tuple[str, Path]:
    out, run_dir = tmp_path / name, tmp_path / f"{name}-run"
    result = procs.run(["run", "--nnodes", 1, "--nproc-per-node", 2, "--run-dir", run_dir, "--stop-grace", 2,
                        fixture(script), "--out", out, *extra], env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.explain()
    assert f"trained to step {steps}" in result.stdout, result.explain()
    return result.stdout, out


def _steps(out: Path, rank: int) -> list[tuple[int, str]]:
    lines = (out / f"steps.rank{rank}.txt").read_text().split("\n")
    return [(int(step), round_id) for step, round_id in (line.split() for line in lines if line)]


def test_with_an_overhead_budget_a_killed_rank_redoes_fewer_than_k_steps_bit_identical(procs: ProcessScope,
                                                                                        tmp_path: Path) -> None:
    """``ConvoyCallback(max_overhead=0.05)``: the job says k (k is what this machine measures), and a rank killed
    mid-way through the third epoch costs at most k - 1 finished steps, redone from the same data."""
    _, clean = _train(procs, tmp_path, "clean", "--max-overhead", 0.05)
    rank, kill_at = KILLS[1]
    stdout, killed = _train(procs, tmp_path, "killed", "--max-overhead", 0.05, "--kill", f"{rank}:{kill_at}")
    said = [int(k) for k in re.findall(r"snapshots every (\d+) step\(s\): .* \(budget 5\.00%\); a failure may cost up "
                                       r"to \d+ finished step\(s\)", stdout)]
    assert said, stdout
    resumed = int(re.search(r"resuming at global step (\d+)", stdout).group(1))
    assert kill_at - max(said) < resumed <= kill_at, f"k = {max(said)}: the resume lost {kill_at - resumed} steps"
    for each in (0, 1):
        counts = Counter(step for step, _ in _steps(killed, each))
        assert sorted(counts) == list(range(1, STEPS + 1))
        assert sorted(step for step, count in counts.items() if count > 1) == list(range(resumed + 1, kill_at + 1))
    first, again = torch.load(clean / "weights.pt"), torch.load(killed / "weights.pt")
    assert [name for name in first if not torch.equal(first[name], again[name])] == []


def test_killed_ranks_resume_lightning_with_no_step_redone_bit_identical(procs: ProcessScope,
                                                                          tmp_path: Path) -> None:
    _, clean = _train(procs, tmp_path, "clean")
    for rank in (0, 1):
        assert [step for step, _ in _steps(clean, rank)] == list(range(1, STEPS + 1))
    kills = [f"{rank}:{step}" for rank, step in KILLS]
    stdout, killed = _train(procs, tmp_path, "killed", *(arg for kill in kills for arg in ("--kill", kill)))
    for rank, step in KILLS:
        assert f"rank {rank}: SIGKILL as step {step + 1} begins" in stdout, stdout
        assert f"resuming at global step {step}" in stdout, stdout
    assert "(epoch 1, 0 batches of it already trained)" in stdout, stdout  # the first kill: at an epoch's end
    assert "(epoch 2, 10 batches of it already trained)" in stdout, stdout  # the second: step 29 = 5 x 2 in
    for rank in (0, 1):
        steps = _steps(killed, rank)
        counts = Counter(step for step, _ in steps)
        assert sorted(counts) == list(range(1, STEPS + 1)), f"rank {rank} missed steps: {steps}"
        assert [step for step, count in counts.items() if count > 1] == [], f"rank {rank} redid steps: {steps}"
        rounds = [round_id for _, round_id in steps]
        assert len(set(rounds)) == 3, f"rank {rank}: {steps}"
        assert [index for index in range(1, STEPS) if rounds[index] != rounds[index - 1]] == [12, 29], steps
    uninterrupted, resumed = torch.load(clean / "weights.pt"), torch.load(killed / "weights.pt")
    assert sorted(uninterrupted) == sorted(resumed)
    different = [name for name in uninterrupted if not torch.equal(uninterrupted[name], resumed[name])]
    assert different == [], f"tensors not bit-identical after two resumes: {different}"
    assert json.loads((killed / "final.json").read_text()) == {"global_step": STEPS, "epoch": 3}
    job_id = re.search(r"^convoy: job (\w+):", stdout, re.MULTILINE)
    assert job_id, stdout
    assert not list(SHM_DIR.glob(f"convoy-{job_id.group(1)}-*")), "the job's shared memory outlived it"


def _drawn(out: Path, rank: int) -> list[tuple[str, str]]:
    """``(round, digest)`` of the training data each round's ``train_dataloader()`` drew on ``rank``."""
    lines = (out / f"data.rank{rank}.txt").read_text().split("\n")
    return [(round_id, digest) for round_id, digest in (line.split() for line in lines if line)]


def test_data_drawn_in_setup_and_train_dataloader_is_drawn_again_the_same_on_resume(procs: ProcessScope,
                                                                                     tmp_path: Path) -> None:
    """Lightning's BoringModel on samples drawn from the global RNG in ``train_dataloader()`` and chosen by
    ``random_split`` in ``setup()``, shuffled from it each epoch: each round builds them from the seed's streams, not
    the snapshot's, and each epoch's order comes from the streams where the loop took them, so the data is the same
    and the weights end bit-identical (they differed by 3e-2 when the snapshot's streams came first)."""
    _, clean = _train(procs, tmp_path, "clean", script="lightning_boring.py", steps=BORING_STEPS)
    kills = [f"{rank}:{step}" for rank, step in BORING_KILLS]
    stdout, killed = _train(procs, tmp_path, "killed", *(arg for kill in kills for arg in ("--kill", kill)),
                            script="lightning_boring.py", steps=BORING_STEPS)
    for rank, step in BORING_KILLS:
        assert f"rank {rank}: SIGKILL as step {step + 1} begins" in stdout, stdout
        assert f"resuming at global step {step}" in stdout, stdout
    for rank in (0, 1):
        [(_, uninterrupted)] = _drawn(clean, rank)
        drawn = _drawn(killed, rank)
        assert len({round_id for round_id, _ in drawn}) == len(drawn) == 4, drawn
        assert [digest == uninterrupted for _, digest in drawn] == [True] * 4, f"rank {rank} drew other data"
        counts = Counter(step for step, _ in _steps(killed, rank))
        assert sorted(counts) == list(range(1, BORING_STEPS + 1)), f"rank {rank} missed steps: {counts}"
        assert max(counts.values()) == 1, f"rank {rank} redid steps: {counts}"
    uninterrupted, resumed = torch.load(clean / "weights.pt"), torch.load(killed / "weights.pt")
    different = [name for name in uninterrupted if not torch.equal(uninterrupted[name], resumed[name])]
    assert different == [], f"tensors not bit-identical after three resumes: {different}"


def test_outside_convoy_the_lightning_callback_warns_and_training_is_unchanged(procs: ProcessScope,
                                                                               tmp_path: Path) -> None:
    out = tmp_path / "plain"
    result = procs.run([fixture("lightning_train.py"), "--out", out, "--epochs", 1, "--samples", 24],
                       command=[sys.executable], env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.explain()
    assert "ConvoyCallback: not under `convoy run`" in result.output, result.explain()
    assert [step for step, _ in _steps(out, 0)] == list(range(1, 7)), "one process: 12 batches of 2, 2 a step"
    assert (out / "weights.pt").exists() and not list(out.glob("checkpoints"))
