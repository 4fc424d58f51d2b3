"""Section (4) of ``benchmarks/gpu.py``: the strategy search on one device, its pick against the exhaustive best of
its feasible candidates (``benchmarks/strategy.py``'s grid, in the same run).

On a GPU the dry-run rank takes the device and its memory as the limit (``convoy/strategy/device.py``); the model
is ``examples/train_strategy.py``'s transformer, sized so that a step of its whole batch should not fit in 80 GB
without activation checkpointing or bf16 (the section prints whether plain DDP fit, as the search measured it).
``--quick --device cpu``: a small model under a 110 MB limit, where plain DDP does not fit (the same code paths,
for a smoke run).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

import torch  # noqa: E402
from strategy import EXAMPLE, summarize  # noqa: E402

from convoy.strategy.candidates import Hardware  # noqa: E402
from convoy.strategy.dryrun import run_search  # noqa: E402
from convoy.strategy.report import table  # noqa: E402

GOAL_PICK = 1.05
GPU_MODEL = ["--width", "2048", "--layers", "16", "--heads", "16", "--vocab", "32768", "--context", "2048",
             "--batch", "32"]
"""~0.9B parameters (14 GB of weights, gradients and Adam state in fp32); its activations at 32 x 2048 tokens are
far more than the rest of an 80 GB GPU holds unless checkpointed or in bf16."""
QUICK_MODEL = ["--width", "128", "--layers", "4", "--heads", "4", "--vocab", "2048", "--context", "256", "--batch", "8"]


def bench_strategy(device: str, quick: bool, grid_steps: int = 3, grid_rounds: int = 2) -> list[str]:
    """Runs the search and its grid; returns the target lines."""
    on_gpu = device.startswith("cuda")
    model_args = QUICK_MODEL if quick or not on_gpu else GPU_MODEL
    # on a GPU the limit is the GPU's own memory, as the dry-run rank takes it (strategy/device.py)
    limit = float(torch.cuda.mem_get_info(torch.device(device))[1]) if on_gpu else 110e6
    hardware = Hardware(1, 1, limit, os.cpu_count() or 1)
    # a smoke run halves among 4 candidates rather than 8: the same code paths, in half the time
    result = run_search(EXAMPLE, model_args, hardware, exhaustive_steps=grid_steps, exhaustive_rounds=grid_rounds,
                        keep=4 if quick else 8)
    for note in result["notes"]:
        print(f"note: {note}")
    print(table(result, show_dropped=False))
    summary = summarize("one device", hardware, result)
    fits = "plain DDP fit" if summary["plain_fits"] else "plain DDP did not fit: the first feasible is the baseline"
    print(f"pick {summary['pick']} {summary['pick_s']:.3f} s | best of the grid {summary['best']} "
          f"{summary['best_s']:.3f} s | baseline {summary['baseline']} {summary['baseline_s']:.3f} s ({fits}) | "
          f"search {summary['search_s']:.1f} s, grid {summary['grid_s']:.1f} s | OOMs {summary['ooms']}", flush=True)
    met = on_gpu and summary["vs_best"] <= GOAL_PICK and summary["ooms"] == 0
    where = "" if on_gpu else " [not on a GPU]"
    return [f"target strategy_pick_on_one_gpu: {summary['vs_best']:.3f}x the grid's best, {summary['ooms']} OOM "
            f"({' '.join(model_args)}){where} (goal <= {GOAL_PICK}x) {'met' if met else 'missed'}"]
