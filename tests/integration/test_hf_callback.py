"""A Hugging Face Trainer with ConvoyCallback under convoy (two ranks, DDP on gloo): a rank SIGKILLed in the
second epoch or at the first one's end, the job goes on in a new round from the newest snapshot, no optimizer
step is run twice and the final weights are bit-identical to an uninterrupted run; outside convoy the callback
changes nothing; a model sharded over the ranks (FSDP2) is refused before its first step."""

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
STEPS = 40  # 80 samples, 2 epochs, 2 ranks x batch 2
KILL_POINTS = (27, 20)  # as step 28 begins: one epoch to skip whole, 7 batches of the next; as step 21 (an epoch's end)


def _train(procs: ProcessScope, tmp_path: Path, name: str, *extra: object) -> tuple[str, Path]:
    out, run_dir = tmp_path / name, tmp_path / f"{name}-run"
    result = procs.run(["run", "--nnodes", 1, "--nproc-per-node", 2, "--run-dir", run_dir, "--stop-grace", 2,
                        fixture("hf_train.py"), "--out", out, *extra], env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.explain()
    assert "trained to step 40" in result.stdout, result.explain()
    return result.stdout, out


def _steps(out: Path, rank: int) -> list[tuple[int, str]]:
    lines = (out / f"steps.rank{rank}.txt").read_text().split("\n")
    return [(int(step), round_id) for step, round_id in (line.split() for line in lines if line)]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "weights.pt")


def test_a_killed_rank_resumes_the_trainer_with_no_step_redone_bit_identical(procs: ProcessScope,
                                                                           tmp_path: Path) -> None:
    _, clean = _train(procs, tmp_path, "clean")
    for rank in (0, 1):
        assert [step for step, _ in _steps(clean, rank)] == list(range(1, STEPS + 1))
    uninterrupted = _weights(clean)
    for kill_at in KILL_POINTS:
        stdout, killed = _train(procs, tmp_path, f"killed-{kill_at}", "--kill-rank", 1, "--kill-at-step", kill_at)
        assert f"rank 1: SIGKILL as step {kill_at + 1} begins" in stdout, stdout
        assert f"resuming at global step {kill_at}" in stdout, stdout
        for rank in (0, 1):
            steps = _steps(killed, rank)
            counts = Counter(step for step, _ in steps)
            assert sorted(counts) == list(range(1, STEPS + 1)), f"rank {rank} missed steps: {steps}"
            assert [step for step, count in counts.items() if count > 1] == [], f"rank {rank} redid steps: {steps}"
            rounds = [round_id for _, round_id in steps]
            assert len(set(rounds)) == 2 and rounds[kill_at] != rounds[kill_at - 1], f"rank {rank}: {steps}"
        resumed = _weights(killed)
        assert sorted(uninterrupted) == sorted(resumed)
        different = [name for name in uninterrupted if not torch.equal(uninterrupted[name], resumed[name])]
        assert different == [], f"killed at {kill_at}: tensors not bit-identical after the resume: {different}"
        final = json.loads((killed / "final.json").read_text())
        assert (final["global_step"], final["epoch"]) == (STEPS, 2.0), final
        job_id = re.search(r"^convoy: job (\w+):", stdout, re.MULTILINE)
        assert job_id, stdout
        assert not list(SHM_DIR.glob(f"convoy-{job_id.group(1)}-*")), "the job's shared memory outlived it"


def test_with_an_overhead_budget_the_ranks_snapshot_every_kth_step_and_a_kill_redoes_fewer_than_k(
        procs: ProcessScope, tmp_path: Path) -> None:
    """``ConvoyCallback(max_overhead=0.05)``: k is what this machine measures; the job says it (an event, and
    ``convoy status``), both ranks snapshot the same steps, and a rank killed at step 27 costs at most k - 1
    finished steps, redone from the same data, so the final weights are still the uninterrupted run's."""
    _, clean = _train(procs, tmp_path, "clean", "--max-overhead", 0.05)
    kill_at = KILL_POINTS[0]
    stdout, killed = _train(procs, tmp_path, "killed", "--max-overhead", 0.05, "--kill-rank", 1, "--kill-at-step",
                            kill_at)
    said = re.findall(r"snapshots every (\d+) step\(s\): one costs [\d.]+ ms of a [\d.]+ ms step \([\d.]+%\), so "
                      r"[\d.]+% of the training's time \(budget 5\.00%\); a failure may cost up to (\d+) finished "
                      r"step\(s\)", stdout)
    assert said and all(int(k) - 1 == int(risk) for k, risk in said), stdout
    resumed = int(re.search(r"resuming at global step (\d+)", stdout).group(1))
    every = max(int(k) for k, _ in said)
    assert kill_at - every < resumed <= kill_at, f"k = {every}: the resume lost {kill_at - resumed} steps"
    for rank in (0, 1):
        counts = Counter(step for step, _ in _steps(killed, rank))
        assert sorted(counts) == list(range(1, STEPS + 1))
        assert sorted(step for step, count in counts.items() if count > 1) == list(range(resumed + 1, kill_at + 1))
    uninterrupted, again = _weights(clean), _weights(killed)
    assert [name for name in uninterrupted if not torch.equal(uninterrupted[name], again[name])] == []
    status = procs.run(["status", "--run-dir", tmp_path / "killed-run"])
    assert status.returncode == 0 and re.search(r"^rank 0: snapshots every \d+ step\(s\): .* finished step\(s\) \(said "
                                                r"\d\d:\d\d:\d\d\)$", status.stdout, re.MULTILINE), status.explain()


def test_outside_convoy_the_callback_warns_and_training_is_unchanged(procs: ProcessScope, tmp_path: Path) -> None:
    out = tmp_path / "plain"
    result = procs.run([fixture("hf_train.py"), "--out", out, "--epochs", 1, "--samples", 40],
                       command=[sys.executable], env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.explain()
    assert "ConvoyCallback: not under `convoy run`" in result.output, result.explain()
    assert [step for step, _ in _steps(out, 0)] == list(range(1, 21)), "one process, batch 2, 40 samples"
    assert (out / "weights.pt").exists() and not list(out.glob("checkpoints"))


def test_a_model_sharded_by_fsdp_is_refused_before_its_first_step(procs: ProcessScope, tmp_path: Path) -> None:
    """Each rank of an FSDP model holds its own shard, which a snapshot taken as replicated would hand to a peer:
    the callback names the sharding and what to use instead, and no step runs."""
    out, run_dir = tmp_path / "fsdp", tmp_path / "fsdp-run"
    result = procs.run(["run", "--nnodes", 1, "--nproc-per-node", 2, "--max-restarts", 0, "--run-dir", run_dir,
                        fixture("hf_train.py"), "--out", out, "--fsdp"], env={"OMP_NUM_THREADS": "1"})
    assert result.returncode != 0, result.explain()
    said = [line.split("CheckpointError: ")[1] for line in result.stdout.splitlines() if "CheckpointError: " in line]
    refusals = set(said)
    assert len(refusals) == 1, result.explain()  # one line, the same from both ranks
    refusal = refusals.pop()
    assert "ConvoyCallback" in refusal and "FSDP" in refusal and "DDP" in refusal, refusal
    assert not list(out.glob("steps.rank*.txt")), "a step ran before the refusal"
