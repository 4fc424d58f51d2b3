"""The restore side of benchmarks/checkpoint.py: a worker training with snapshots is SIGKILLed, and fresh
``ckpt_worker.py`` processes time convoy's restore against ``torch.load`` + ``load_state_dict``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from ckpt_loop import Sizes

WORKER = Path(__file__).resolve().parent / "ckpt_worker.py"

JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
           "MASTER_ADDR", "MASTER_PORT", "CONVOY_JOB_ID", "CONVOY_NODE_ID", "CONVOY_RUN_DIR", "CONVOY_ROUND")


def child_env(job_id: str | None) -> dict[str, str]:
    """This environment without the job variables (a child starts its own one-process group)."""
    env = {key: value for key, value in os.environ.items() if key not in JOB_ENV}
    if job_id:
        env["CONVOY_JOB_ID"] = job_id
    return env


def start_worker(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(WORKER), *args], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def await_line(proc: subprocess.Popen[str], prefix: str) -> str:
    """The first line of the worker's output that starts with ``prefix``; fails if it exits first."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    proc.wait()
    raise RuntimeError(f"ckpt_worker.py exited ({proc.returncode}) before '{prefix}':\n{proc.stderr.read()[-3000:]}")


def finish_worker(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Let a ready worker measure; return the JSON it prints."""
    output, errors = proc.communicate("go\n", timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"ckpt_worker.py failed ({proc.returncode}):\n{errors[-3000:]}")
    return json.loads(output.strip().splitlines()[-1])


def measure_restore(sizes: Sizes, job_id: str, root: Path, peer_file: Path, samples: dict[str, list[float]]) -> str:
    """SIGKILL a worker that trains with snapshots, then time restores and torch.loads in fresh processes
    (started together with it, each measuring alone when its turn comes)."""
    model_args = ["--layers", str(sizes.layers), "--width", str(sizes.width), "--batch", str(sizes.batch)]
    ckpt_dir = ["--dir", str(root / "restore-checkpoints")]
    train = start_worker(["train", *model_args, *ckpt_dir], child_env(job_id))
    pairs = [(start_worker(["restore", *model_args, *ckpt_dir], child_env(job_id)),
              start_worker(["load", *model_args, "--file", str(peer_file)], child_env(None)))
             for _ in range(sizes.restores)]
    everyone = [train, *(proc for pair in pairs for proc in pair)]
    watchdog = threading.Timer(1200, lambda: [proc.kill() for proc in everyone])
    watchdog.start()
    try:
        last = -1
        while last < 3:  # both slots written at least once, so the kill hits the steady state
            last = int(await_line(train, "done ").split()[1])
        os.kill(train.pid, signal.SIGKILL)
        train.wait()
        for proc in everyone[1:]:
            await_line(proc, "ready")
        resumed = []
        for restorer, loader in pairs:
            restored = finish_worker(restorer)
            if not restored["from"].startswith("in-memory") or restored["optimizer_tensors"] == 0:
                raise RuntimeError(f"restore did not come from the snapshot: {restored}")
            samples["restore"].append(restored["restore_s"] + restored["first_wait_s"])
            samples["restore_call"].append(restored["restore_s"])
            samples["restore_cpu"].append(restored["restore_cpu_s"])
            samples["restore_wait"].append(restored["first_wait_s"])
            samples["restore_construct"].append(restored["construct_s"])
            resumed.append(restored["start"])
            loaded = finish_worker(loader)
            samples["torch_load"].append(loaded["load_s"])
            samples["torch_load_apply"].append(loaded["load_s"] + loaded["apply_s"])
    finally:
        watchdog.cancel()
        for proc in everyone:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
    return (f"the worker was SIGKILLed after it reported step {last} finished; the restores resumed at step "
            f"{', '.join(map(str, sorted(set(resumed))))} (newest complete snapshot + 1)")
