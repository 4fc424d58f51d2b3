"""The memory model against measured peaks: a small transformer profiled (fake-tensor trace + one real
micro-step) and trained with four strategies in one process (tests/fixtures/strategy_memory_check.py);
a model fake tensors cannot run is traced on real ones, said so."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import FIXTURES, REPO

pytestmark = pytest.mark.slow

SCRIPT = str(FIXTURES / "strategy_memory_check.py")


def run(*args: str) -> str:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_predicted_peaks_are_within_ten_percent_of_measured() -> None:
    out = run()
    assert "traced on: meta" in out, out
    errors = {name: float(e) for name, e in re.findall(r"^(.+): predicted .* error ([-+.\d]+)$", out, re.MULTILINE)}
    assert set(errors) == {"ddp mb8x1 t1", "ddp mb4x2 t1", "ddp ckpt mb8x1 t1", "ddp ckpt mb2x4 t1"}, out
    assert all(abs(e) <= 0.10 for e in errors.values()), out


def test_a_model_fake_tensors_cannot_run_is_measured_instead() -> None:
    out = run("--unfakeable")
    assert "traced on: real" in out, out
    assert "cannot run on fake (meta) tensors" in out and "measured in a real micro-step instead" in out, out
    errors = [float(e) for e in re.findall(r"error ([-+.\d]+)$", out, re.MULTILINE)]
    assert len(errors) == 4 and all(abs(e) <= 0.10 for e in errors), out
