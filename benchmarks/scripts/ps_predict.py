"""The prediction section of benchmarks/ps.py: a worker's memory from one measured iteration, checked against
the worker's real peak over 100 iterations under the predicted limit.

Per configuration (ps_memory_worker.py: one embedding table with Adagrad and an MLP with Adam): one process
runs with ``--handshake`` while ``TreeSampler`` samples it: the baseline before the model is built, the peak
RSS of iteration 0 (convoy's one measured iteration), and the RSS after each of iterations 0-4 (DLRover's five
step samples of ``psutil.virtual_memory().used``, which in a container holding only this worker is its
memory less the page cache; the RSS stands for it, since on this shared host the libraries' pages are charged
to whichever cgroup read them first). ``sizing.predict`` gives the worker's need; the limit adds the margin of a
``MarginModel`` that has recorded every earlier configuration's error (the prior alone for the first). The
worker then trains 100 iterations with that limit enforced (``MemoryLimiter``: cgroup, else the RSS
watchdog) while a ``TreeSampler`` keeps its peak RSS. Over-allocation is limit / measured peak - 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from convoy.agent.memory import TreeSampler  # noqa: E402
from convoy.agent.memory_limits import MemoryLimiter  # noqa: E402
from convoy.control.roles.memory_model import (  # noqa: E402,E501
    IterationShape,
    MarginModel,
    MeasuredIteration,
    dlrover_allocation,
    predict,
)

WORKER = Path(__file__).resolve().parent / "ps_memory_worker.py"
ITERATIONS, DLROVER_STEPS = 100, 5
PEAK_TOL, OVER_GOAL = 0.10, 0.15
MIB = 1 << 20


@dataclass(frozen=True)
class Config:
    name: str
    rows: int
    dim: int
    hidden: str
    batch: int

    def argv(self, iterations: int) -> list[str]:
        return [sys.executable, str(WORKER), "--rows", str(self.rows), "--dim", str(self.dim), "--hidden",
                self.hidden, "--batch", str(self.batch), "--iterations", str(iterations)]


CONFIGS = (
    Config("small", 50_000, 16, "256,128", 64),
    Config("mlp-wide", 20_000, 16, "2048,2048,1024", 256),
    Config("mid", 400_000, 32, "1024,512", 1024),
    Config("big-batch", 200_000, 32, "512,256", 4096),
    Config("5M-rows", 5_000_000, 8, "512,256", 512),
    Config("50M", 1_500_000, 32, "1024,512", 2048),
)
QUICK = (Config("small", 50_000, 16, "256,128", 64), Config("big-batch", 200_000, 32, "512,256", 4096))


def env() -> dict[str, str]:
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def measure(config: Config) -> tuple[MeasuredIteration, list[int], int]:
    """The handshake run: the baseline, iteration 0's peak, and DLRover's five step samples."""
    proc = subprocess.Popen([*config.argv(DLROVER_STEPS), "--handshake"], env=env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        sampler = TreeSampler(proc.pid).start()
        peaks, samples = {}, []
        while (line := proc.stdout.readline().strip()) and not line.startswith("{"):
            if line == "baseline":
                sampler.sample_once()
                peaks["baseline"] = sampler.window()
            elif line == "start 0":
                sampler.window()
            elif line.startswith("end"):
                samples.append(sampler.sample_once().rss_bytes)
                if line == "end 0":
                    peaks["iteration"] = sampler.window()
            proc.stdin.write("go\n")
            proc.stdin.flush()
        shape_info = json.loads(line)
        proc.wait(timeout=120)
        sampler.stop()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{config.name}: the measuring process exited {proc.returncode}")
    shape = IterationShape(shape_info["state_bytes"], config.batch, shape_info["sample_bytes"])
    base, it = peaks["baseline"], peaks["iteration"]
    return (MeasuredIteration(shape, it.rss_bytes, it.uss_bytes, base.rss_bytes, base.uss_bytes), samples,
            shape_info["params"])


def run_worker(config: Config, limiter: MemoryLimiter, limit_bytes: int) -> tuple[int, int, str]:
    """100 iterations under the limit: (peak RSS sampled, OOM kills, mechanism)."""
    limit = limiter.limit(f"bench-worker-{config.name}", limit_bytes)
    proc = subprocess.Popen(config.argv(ITERATIONS), env=env(), stdout=subprocess.DEVNULL)
    try:
        limit.add(proc.pid)
        sampler = TreeSampler(proc.pid).start()
        proc.wait(timeout=900)
        peak = sampler.stop()
        outcome = limit.outcome()
    finally:
        limit.close()
    kills = outcome.oom_kills + (1 if proc.returncode == -9 and not outcome.oom_kills else 0)
    return peak.rss_bytes, kills, limit.mechanism


def predict_section(quick: bool) -> list[str]:
    limiter = MemoryLimiter(warn=lambda message: print(message, flush=True))
    margins = MarginModel()
    rows, lines = [], []
    for config in QUICK if quick else CONFIGS:
        measured, samples, params = measure(config)
        prediction = predict(measured, measured.shape, margins.margin())
        peak, kills, mechanism = run_worker(config, limiter, prediction.limit_bytes)
        error = margins.record(prediction.rss_bytes, peak)
        dlrover = dlrover_allocation(samples)
        rows.append((config, params, measured, prediction, peak, kills, error, dlrover, mechanism))
        print(f"  {config.name}: predicted {prediction.rss_bytes / MIB:.0f} MiB, measured {peak / MIB:.0f} MiB "
              f"({100 * error:+.1f}%), limit {prediction.limit_bytes / MIB:.0f} MiB, OOM {kills}", flush=True)
    lines.append(f"worker memory predicted from one measured iteration, then {ITERATIONS} iterations under that "
                 f"limit ({rows[0][8]}); MALLOC_MMAP_THRESHOLD_=131072; margin learnt from the configurations "
                 f"before (MarginModel)")
    lines.append("")
    lines.append(f"{'config':10} {'params':>7} {'rows':>9} {'batch':>5} {'baseline':>8} {'iter 0':>7} "
                 f"{'predicted':>9} {'margin':>6} {'limit':>7} {'measured':>8} {'error':>7} {'OOM':>3} "
                 f"{'over':>6} {'DLRover':>8} {'DL over':>7}")
    for config, params, measured, prediction, peak, kills, error, dlrover, _ in rows:
        lines.append(f"{config.name:10} {params / 1e6:6.1f}M {config.rows:9d} {config.batch:5d} "
                     f"{measured.baseline_rss_bytes / MIB:8.0f} {measured.peak_rss_bytes / MIB:7.0f} "
                     f"{prediction.rss_bytes / MIB:9.0f} {100 * prediction.margin:5.1f}% "
                     f"{prediction.limit_bytes / MIB:7.0f} {peak / MIB:8.0f} {100 * error:+6.1f}% {kills:3d} "
                     f"{100 * (prediction.limit_bytes / peak - 1):5.1f}% {dlrover / MIB:8.0f} "
                     f"{100 * (dlrover / peak - 1):6.1f}%")
    lines.append("(MiB; error = measured / predicted - 1; over = limit / measured - 1; DLRover = 1.5 x the "
                 "largest of 5 container-wide step samples)")
    worst = max(abs(r[6]) for r in rows)
    ooms = sum(r[5] for r in rows)
    over = sum(r[3].limit_bytes / r[4] - 1 for r in rows) / len(rows)
    dl_over = sum(r[7] / r[4] - 1 for r in rows) / len(rows)
    lines += ["", f"target prediction_error: worst {100 * worst:.1f}% over {len(rows)} configurations "
                  f"(goal within +-{100 * PEAK_TOL:.0f}%) {'met' if worst <= PEAK_TOL else 'missed'}",
              f"target oom_kills: {ooms} (goal 0) {'met' if ooms == 0 else 'missed'}",
              f"target over_allocation: mean {100 * over:.1f}% (DLRover's rule: {100 * dl_over:.1f}%) "
              f"(goal <= {100 * OVER_GOAL:.0f}%) {'met' if over <= OVER_GOAL else 'missed'}"]
    return lines
