"""The memory model against measured peaks: a small transformer profiled (fake-tensor trace + one real
micro-step) and trained with four strategies in one process (tests/fixtures/strategy_memory_check.py);
a model fake tensors cannot run is traced on real ones, said so; FSDP on four gloo ranks, calibrated in
two real micro-steps (and a candidate's peak the same after itself or another), each pipeline rank on four,
sequences cut over two ranks, and DDP and ZeRO over the hierarchical allreduces on two nodes of two
(tests/fixtures/strategy_fsdp_check.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import FIXTURES, REPO, ProcessScope

pytestmark = pytest.mark.slow

SCRIPT = str(FIXTURES / "strategy_memory_check.py")


def run(*args: str) -> str:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def errors_by_strategy(out: str) -> dict[str, float]:
    """``<strategy>: predicted P MB measured M MB error E`` lines, as {strategy: E}."""
    return {name: float(e) for name, e in re.findall(r"^(.+): predicted .* error ([-+.\d]+)$", out, re.MULTILINE)}


def test_predicted_peaks_are_within_ten_percent_of_measured() -> None:
    out = run()
    assert "traced on: meta" in out, out
    errors = errors_by_strategy(out)
    assert set(errors) == {"ddp mb8x1 t1", "ddp mb4x2 t1", "ddp ckpt mb8x1 t1", "ddp ckpt mb2x4 t1"}, out
    assert all(abs(e) <= 0.10 for e in errors.values()), out


def test_a_model_fake_tensors_cannot_run_is_measured_instead() -> None:
    out = run("--unfakeable")
    assert "traced on: real" in out, out
    assert "cannot run on fake (meta) tensors" in out and "measured in a real micro-step instead" in out, out
    errors = [float(e) for e in re.findall(r"error ([-+.\d]+)$", out, re.MULTILINE)]
    assert len(errors) == 4 and all(abs(e) <= 0.10 for e in errors), out


def test_fsdp_calibrated_in_two_micro_steps_predicts_each_fsdp_peak_within_ten_percent(procs: ProcessScope) -> None:
    out = procs.gloo_ranks(str(FIXTURES / "strategy_fsdp_check.py"), 4, [],
                           env={"MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)})[0]
    assert re.search(r"FSDP calibrated on real micro-steps of 1 and 8 sample\(s\): peaks [\d.]+ and", out), out
    errors = errors_by_strategy(out)
    assert set(errors) == {"fsdp mb8x1 t1", "fsdp mb2x4 t1", "fsdp ckpt mb8x1 t1"}, out
    assert all(abs(e) <= 0.10 for e in errors.values()), out


def test_a_candidate_measured_after_others_reads_the_peak_it_read_first(procs: ProcessScope) -> None:
    """What an earlier run freed and the allocator kept must not lower a later run's peak: FSDP mb2x4 read 10-17% less
    after itself or mb8x1, and the FSDP test above failed one run in several; now within 2.1%."""
    out = procs.gloo_ranks(str(FIXTURES / "strategy_fsdp_check.py"), 2, ["--again"],
                           env={"MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)})[0]
    runs: dict[str, list[float]] = {}
    for name, measured in re.findall(r"^(.+) run \d+: measured ([\d.]+) MB$", out, re.MULTILINE):
        runs.setdefault(name, []).append(float(measured))
    assert sorted(map(len, runs.values())) == [2, 3], out
    assert all(abs(again / first - 1) <= 0.05 for first, *later in runs.values() for again in later), out


def test_each_pipeline_rank_peak_is_predicted_within_ten_percent(procs: ProcessScope) -> None:
    out = procs.gloo_ranks(str(FIXTURES / "strategy_fsdp_check.py"), 4, ["--pipelines"],
                           env={"MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)})[0]
    errors = errors_by_strategy(out)
    assert set(errors) == {"pipeline p2/1f1b mb4x2 t1", "pipeline p4/1f1b mb8x1 t1", "pipeline p2/interleaved mb4x2 t1",
                           "pipeline p4/1f1b bf16 mb4x2 t1"}, out
    assert all(abs(e) <= 0.10 for e in errors.values()), out


def test_each_sequence_cut_peak_is_predicted_within_ten_percent(procs: ProcessScope) -> None:
    out = procs.gloo_ranks(str(FIXTURES / "strategy_fsdp_check.py"), 2, ["--sequences"],
                           env={"MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)})[0]
    errors = errors_by_strategy(out)
    assert set(errors) == {"sequence s2 mb4x2 t1", "sequence s2 mb2x4 t1", "sequence s2 bf16 mb8x1 t1",
                           "sequence s2 bf16 mb4x2 t1"}, out
    assert all(abs(e) <= 0.10 for e in errors.values()), out


def test_ddp_and_zero_over_the_hierarchical_allreduces_are_predicted_within_ten_percent(procs: ProcessScope) -> None:
    out = procs.gloo_ranks(str(FIXTURES / "strategy_fsdp_check.py"), 4, ["--hierarchical"],
                           env={"MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)})[0]
    errors = errors_by_strategy(out)
    assert set(errors) == {"ddp/leader mb1x8 t1", "zero/leader mb4x2 t1", "zero/reduce_scatter mb1x8 t1"}, out
    assert all(abs(e) <= 0.10 for e in errors.values()), out  # gloo's whole copy of the gradient: +21%, +18%, +21%
