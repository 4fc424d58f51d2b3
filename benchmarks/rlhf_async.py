"""The asynchrony section of ``benchmarks/rlhf.py``: the same GRPO job with k = 0 (synchronous: a version's groups are
made, then trained on, while the other side waits) and k = 1 (the rollouts make the next step's groups while the
trainer trains), the same number of samples, long responses (``max_new_tokens`` 48: the base model's answers run
from one token to the bound, a heavy tail). Measured: samples trained per second between the first and the last
evaluation, the held-out reward at the end, and the groups trained beyond k (the trainer refuses any: the job would
fail). Targets: k = 1 >= 1.8x the samples/s of k = 0; its reward within 5 points."""

from __future__ import annotations

import re

from rlhf_learning import run_job

SETTINGS = ["max_new_tokens=48", "eval_every=1000"]


def rate(points: list[tuple[float, int, float]]) -> float:
    (began, _, _), (ended, samples, _) = points[0], points[-1]
    return samples / (ended - began)


def bench_async(steps: int) -> list[str]:
    print(f"\n## asynchrony: k = 0 against k = 1, {steps} steps each (the same samples), long responses")
    results = {}
    for lag in (0, 1):
        points, tail = run_job([f"max_lag={lag}", f"steps={steps}", *SETTINGS])
        stale = re.search(r"(\d+) dropped as stale \(k = \d\), none trained beyond k", "\n".join(tail))
        results[lag] = (rate(points), points[-1][2], stale.group(1) if stale else "?")
        print(f"  k = {lag}: {results[lag][0]:.2f} samples/s, held-out reward {results[lag][1]:.1f}% after "
              f"{points[-1][1]} samples, {results[lag][2]} groups dropped as stale, none trained beyond k", flush=True)
    speedup = results[1][0] / results[0][0]
    gap = results[1][1] - results[0][1]
    return [f"target k = 1 / k = 0 samples/s: {speedup:.2f}x (goal >= 1.8x) {'met' if speedup >= 1.8 else 'missed'}",
            f"target k = 1 reward - k = 0 reward after the same samples: {gap:+.1f} points (goal >= -5) "
            f"{'met' if gap >= -5 else 'missed'}"]
