"""The learning section of ``benchmarks/rlhf.py``: ``convoy run examples/grpo.toml`` as a user runs it (SmolLM2-135M-
Instruct, the arithmetic task), bounded in minutes of training, with the held-out reward read from the trainer's
lines as they come (wall-clock time since the launch) and the curve saved as a PNG beside the results. Target: the
held-out reward rises by >= 30 points over the base model's within 30 minutes of wall-clock time on this machine."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HELD_OUT = re.compile(r"held-out reward ([\d.]+)% after (\d+) samples \(version (\d+)")


def run_job(settings: list[str], curve_name: str = "") -> tuple[list[tuple[float, int, float]], list[str]]:
    """(seconds since the launch, samples, held-out reward in %) at each evaluation, and the job's summary lines."""
    run_dir = Path(tempfile.mkdtemp(prefix="convoy-bench-grpo-"))
    command = [sys.executable, "-m", "convoy", "run", "--run-dir", str(run_dir), str(REPO / "examples" / "grpo.toml"),
               "--set", "plot=reward-curve.png", *[part for pair in settings for part in ("--set", pair)]]
    print(f"  $ convoy run examples/grpo.toml {' '.join('--set ' + s for s in settings)}", flush=True)
    began = time.monotonic()
    points: list[tuple[float, int, float]] = []
    tail: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO) as job:
        assert job.stdout is not None
        for line in job.stdout:
            found = HELD_OUT.search(line)
            if found:
                points.append((time.monotonic() - began, int(found.group(2)), float(found.group(1))))
                print(f"    {points[-1][0]:7.0f} s  {points[-1][1]:6d} samples  version {found.group(3):>4}  "
                      f"held-out reward {points[-1][2]:5.1f}%", flush=True)
            elif re.search(r"trainer: \d+ steps|store: \d+ prompts issued|rollout \d: \d+ groups kept|job (succeeded|"
                           r"failed)|finished in", line):
                tail.append(line.rstrip())
        code = job.wait()
    for line in tail:
        print(f"    {line}")
    if code != 0:
        raise RuntimeError(f"the GRPO job failed (exit {code}); its run dir: {run_dir}")
    curve = run_dir / "reward-curve.png"
    if curve_name and curve.exists():
        shutil.copy(curve, REPO / "benchmarks" / "results" / curve_name)
        print(f"  curve: benchmarks/results/{curve_name}")
    shutil.rmtree(run_dir, ignore_errors=True)
    return points, tail


def bench_learning(minutes: float, settings: list[str]) -> list[str]:
    print(f"\n## learning: GRPO on SmolLM2-135M-Instruct, arithmetic, {minutes:g} minutes of training")
    points, _ = run_job([f"minutes={minutes}", "steps=100000", *settings], "rlhf-reward-curve.png")
    base = points[0][2]
    within = [p for p in points if p[0] <= 30 * 60]
    best = max(within, key=lambda p: p[2])
    gain = best[2] - base
    return [f"target held-out reward rise within 30 minutes: {base:.1f}% -> {best[2]:.1f}% at {best[0] / 60:.1f} min "
            f"({best[1]} samples), +{gain:.1f} points (goal >= +30) {'met' if gain >= 30 else 'missed'}"]
