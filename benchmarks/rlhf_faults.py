"""The fault section of ``benchmarks/rlhf.py``: the GRPO job as a user runs it (SmolLM2-135M-Instruct, 2 rollouts,
k = 1, a prompt's lease 5 s), one rollout SIGSTOPped mid-run and continued a minute later. Measured: the time from
the SIGSTOP to the store's line that it is presumed stopped (its prompts given back to the queue at that tick), and
the longest a trainer step waited for its groups over the run. Targets: detected and reassigned <= 10 s; the trainer
never blocked > 10 s."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STOPPED_S = 60.0
LEASED_S = 1.0


def bench_faults(minutes: float) -> list[str]:
    print(f"\n## faults: a rollout SIGSTOPped for {STOPPED_S:.0f} s in a {minutes:g}-minute run")
    run_dir = Path(tempfile.mkdtemp(prefix="convoy-bench-grpo-faults-"))
    command = [sys.executable, "-m", "convoy", "run", "--run-dir", str(run_dir), str(REPO / "examples" / "grpo.toml"),
               "--set", f"minutes={minutes}", "--set", "steps=100000", "--set", "plot=", "--set", "eval_every=1000"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    assert job.stdout is not None
    pid = stopped_at = detected = given = None
    continued = False
    tail = []
    for line in job.stdout:
        found = re.search(r"rollout 1: pid (\d+)", line)
        if found:
            pid = int(found.group(1))
        if pid and stopped_at is None and re.search(r"trainer 0 published version 3:", line):
            time.sleep(LEASED_S)  # the version's prompts are leased as it is published: stop it making one
            os.kill(pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            print(f"  rollout 1 stopped {LEASED_S:g} s after version 3 was published", flush=True)
        if stopped_at and detected is None and re.search(r"store: rollout:1:\d+ renewed no lease for", line):
            detected = time.monotonic() - stopped_at
            given = re.search(r"its (\d+) prompt", line)
            print(f"  {line.strip()}  ({detected:.1f} s after the SIGSTOP)", flush=True)
        if stopped_at and not continued and time.monotonic() - stopped_at > STOPPED_S:
            os.kill(pid, signal.SIGCONT)  # type: ignore[arg-type]
            continued = True
            print("  rollout 1 continued", flush=True)
        if re.search(r"answers again|trainer: \d+ steps|rollout \d: \d+ groups kept|store: \d+ prompts issued|job "
                     r"(succeeded|failed)", line):
            tail.append(line.rstrip())
    job.wait()
    for line in tail:
        print(f"    {line}")
    longest = re.search(r"longest ([\d.]+) s", "\n".join(tail))
    waited = float(longest.group(1)) if longest else float("inf")
    seen = detected if detected is not None else float("inf")
    held = given.group(1) if given else "?"
    return [f"target a SIGSTOPped rollout detected and its prompts ({held}) reassigned: {seen:.1f} s (goal <= 10 s) "
            f"{'met' if seen <= 10 else 'missed'}",
            f"target the trainer's longest wait for a step's groups: {waited:.1f} s (goal <= 10 s) "
            f"{'met' if waited <= 10 else 'missed'}"]
