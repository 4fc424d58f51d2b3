"""The divergence target of benchmarks/live_config.py: an injected 100x learning rate, caught and rolled back.

Two runs of examples/train_live_config.py (2 nodes x 1 worker, a persistent checkpoint every 10 steps) to the
same last step: the control run, and one where ``lr`` is set 100x higher at about step ``INJECT`` with the
opt-in rollback policy (``--auto-apply divergence``). The detection delay is the proposal's step minus the
step the bad lr took effect at; the outcome is the rolled-back run's final loss against the control's (mean of
the last 10 steps over the ranks, from the ranks' logs). Repeated ``--repeats`` times in turn.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_live_config.py"
CONVOY = [sys.executable, "-m", "convoy"]
INJECT, STEPS, TAIL = 60, 200, 10
DETECT_GOAL, LOSS_GOAL = 5, 0.02


def run_job(tmp: Path, inject: bool) -> dict[str, object]:
    """One run; returns its final loss, and for an injected run the steps of the change and of the proposal."""
    logs, run_dir = tmp / "logs", tmp / "run"
    logs.mkdir(parents=True)
    argv = [*CONVOY, "run", "--nnodes", "2", "--run-dir", str(run_dir), "--stop-grace", "2",
            "--set", f"steps={STEPS}", *(["--auto-apply", "divergence"] if inject else []),
            str(EXAMPLE), "--persist-every", "10", "--step-time", "0.02", "--log-dir", str(logs)]
    with open(tmp / "console.log", "wb") as console:
        job = subprocess.Popen(argv, stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
        out: dict[str, object] = {}
        if inject:
            deadline = time.monotonic() + 120
            while _newest(logs) < INJECT and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            told = subprocess.run([*CONVOY, "config", "set", "--run-dir", str(run_dir), "lr=1.0"],
                                  capture_output=True, text=True, timeout=60)
            found = re.search(r"from step (\d+)", told.stdout)
            out["bad_step"] = int(found.group(1)) if found else None
        code = job.wait(timeout=600)
    text = (tmp / "console.log").read_text(errors="replace")
    if code != 0:
        raise SystemExit(f"the job in {tmp} failed ({code}):\n{text[-2000:]}")
    proposal = re.search(r"proposal \d+ \(divergence at step (\d+)\)", text)
    rollback = re.search(r"roll back to step (\d+)", text)
    out.update(final=_final_loss(logs), proposal_step=int(proposal.group(1)) if proposal else None,
               rollback=int(rollback.group(1)) if rollback else None)
    return out


def _rows(logs: Path) -> dict[int, dict[int, float]]:
    """Each rank's loss by step (a step run again after a rollback: its last run)."""
    out: dict[int, dict[int, float]] = {}
    for path in logs.glob("rank*.log"):
        losses: dict[int, float] = {}
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                losses[int(parts[0])] = float(parts[3])
        out[int(path.stem.removeprefix("rank"))] = losses
    return out


def _newest(logs: Path) -> int:
    rows = _rows(logs)
    return min((max(losses) for losses in rows.values() if losses), default=-1) if rows else -1


def _final_loss(logs: Path) -> float:
    rows = _rows(logs)
    return statistics.fmean(losses[step] for losses in rows.values() for step in range(STEPS - TAIL, STEPS))


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    delays, gaps = [], []
    lines = [f"divergence: lr 0.01 -> 1.0 (100x) at about step {INJECT} of {STEPS}, 2 nodes x 1 worker, a persistent "
             f"checkpoint every 10 steps, --auto-apply divergence; control: the same run without the change"]
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="convoy-bench-div-") as tmp:
            control = run_job(Path(tmp) / "control", inject=False)
            injected = run_job(Path(tmp) / "injected", inject=True)
        delay = (injected["proposal_step"] - injected["bad_step"]  # type: ignore[operator]
                 if injected["proposal_step"] is not None and injected["bad_step"] is not None else None)
        gap = abs(injected["final"] - control["final"]) / control["final"]  # type: ignore[operator]
        delays.append(delay)
        gaps.append(gap)
        lines.append(f"  repeat {repeat + 1}: bad lr from step {injected['bad_step']}, divergence proposed at step "
                     f"{injected['proposal_step']} (delay {delay}), rolled back to step {injected['rollback']}; "
                     f"final loss {injected['final']:.6f} vs control {control['final']:.6f} ({gap:+.2%}); "
                     f"load average {os.getloadavg()[0]:.1f}")
    worst = max((d for d in delays if d is not None), default=None)
    detect_met = all(d is not None and d <= DETECT_GOAL for d in delays)
    loss_met = all(g <= LOSS_GOAL for g in gaps)
    lines.append(f"target divergence_detect: detected {worst if worst is not None else 'never'} steps after the bad lr "
                 f"took effect at worst over {len(delays)} runs (goal <= {DETECT_GOAL}) "
                 f"{'met' if detect_met else 'missed'}")
    lines.append(f"target divergence_rollback: final loss within {max(gaps):.2%} of the control run at worst (median "
                 f"{statistics.median(gaps):.2%}; goal <= {LOSS_GOAL:.0%}) {'met' if loss_met else 'missed'}")
    return lines


if __name__ == "__main__":
    print("\n".join(main()), flush=True)
