"""The TRL section of ``benchmarks/rlhf.py``: ``convoy run examples/grpo.toml`` (k = 1, its rollouts and trainer as
roles) against TRL's ``GRPOTrainer`` (``scripts/rlhf_trl.py``: one process, generation then training in turn) on the
same model, task, group size and number of samples. Measured on each: samples trained per second from the first
training step to the end of the held-out evaluation after the last (the convoy job's trainer evaluates the base model
first: its clock starts when that ends; TRL's when ``train()`` begins), and that held-out reward.

TRL runs twice: with its defaults (bf16 autocast, gradient checkpointing) and in float32 without checkpointing (as
the convoy job trains); the faster is the peer. The job runs with its defaults (float32). Targets: convoy's
samples/s >= 1.5x TRL's; its reward after the same samples not lower."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from rlhf_async import rate
from rlhf_learning import run_job

REPO = Path(__file__).resolve().parents[1]
TRL_RUNS = {"TRL (its defaults: bf16)": [], "TRL, fp32, no checkpointing": ["--float32", "--no-gradient-checkpointing"]}
CONVOY_RUNS = {"convoy (its defaults: fp32)": []}
DONE = re.compile(r"trl: (\d+) samples in ([\d.]+) s \(training ([\d.]+) s, evaluation ([\d.]+) s\), held-out reward "
                  r"([\d.]+)%")


def run_trl(steps: int, settings: list[str], flags: list[str]) -> tuple[float, float]:
    """TRL's samples/s and held-out reward (%) after ``steps`` steps."""
    arguments = ["--steps", str(steps), *[part for pair in settings for part in ("--set", pair)], *flags]
    command = [sys.executable, str(REPO / "benchmarks" / "scripts" / "rlhf_trl.py"), *arguments]
    print(f"  $ python benchmarks/scripts/rlhf_trl.py {' '.join(arguments)}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=7200)
    steps_said = [line for line in done.stdout.splitlines() if line.startswith("trl: step")]
    if steps_said:
        print(f"    {steps_said[0]} ... {steps_said[-1]}")
    found = DONE.search(done.stdout)
    if done.returncode or found is None:
        raise RuntimeError(f"TRL's run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(f"    {found.group(0)}", flush=True)
    return int(found.group(1)) / float(found.group(2)), float(found.group(5))


def bench_trl(steps: int, settings: list[str]) -> list[str]:
    print(f"\n## TRL: convoy's GRPO job (k = 1) against TRL's GRPOTrainer, {steps} steps each (the same samples)")
    if importlib.util.find_spec("trl") is None:
        return ["target convoy / TRL samples/s: not measured: trl is not installed here (pip install trl "
                "torch==2.13.0)"]
    shared = ["eval_every=1000", *settings]
    peers = {name: run_trl(steps, shared, flags) for name, flags in TRL_RUNS.items()}
    ours = {}
    for name, extra in CONVOY_RUNS.items():
        points, _ = run_job([f"steps={steps}", *shared, *extra])
        ours[name] = (rate(points), points[-1][2])
    for name, (speed, reward) in {**ours, **peers}.items():
        print(f"  {name:<32} {speed:.2f} samples/s, held-out reward {reward:5.1f}% after {steps} steps", flush=True)
    convoy_rate, convoy_reward = ours["convoy (its defaults: fp32)"]
    trl_rate, trl_reward = max(peers.values())  # the faster of TRL's two configurations is the peer
    speedup = convoy_rate / trl_rate
    gap = convoy_reward - trl_reward
    return [f"target convoy / TRL samples/s: {speedup:.2f}x (goal >= 1.5x) {'met' if speedup >= 1.5 else 'missed'}",
            f"target convoy reward - TRL reward after the same samples: {gap:+.1f} points (goal >= 0) "
            f"{'met' if gap >= 0 else 'missed'}"]
