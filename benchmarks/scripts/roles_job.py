"""The role scripts of ``benchmarks/roles.py`` (one file, dispatched on ``convoy.role().name``).

- ``ctl`` scales ``probe`` up one process at a time, ``--scale-ups`` times: before each ``convoy.scale`` it
  takes the wall time, and the new probe writes its own wall time as its script begins
  (``RUN_DIR/probe-<rank>.txt``): ``RUN_DIR/scale-ups.txt`` gets one latency per line.
- ``probe`` imports torch (as an RL actor would), writes when it began, and waits to be stopped.
- ``trainer`` (a role group of 2) runs ``roles_trainer.py``'s training with an in-memory snapshot after every step
  (its rank 1 SIGKILLs itself ``--kills`` times, once every ``--kill-every`` steps).
- ``bystander`` (a service) writes its incarnation once as it starts and waits to be stopped: a restart of any
  process of another role would show as a second line.
- ``worker`` (elastic, 0.5 CPU each) takes units of work from a shard queue, one line each in
  ``RUN_DIR/units-done.txt``, and exits after its unit once preempted.
- ``preemptor`` scales ``worker`` to 4, then ``--preemptions`` times runs ``convoy preempt`` for a job of priority 10
  that needs one CPU more than the pool has free, for 1 s; ``RUN_DIR/preemptions.txt`` gets, per preemption, the
  seconds until the CPUs were free and from the preempting job's end until ``worker`` ran 4 again.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import convoy

sys.path.insert(0, str(Path(__file__).resolve().parent))
RUN_DIR = Path(os.environ.get("CONVOY_RUN_DIR", "."))


def ctl(args: argparse.Namespace) -> None:
    out = RUN_DIR / "scale-ups.txt"
    for count in range(2, args.scale_ups + 2):
        began = time.time()
        granted = convoy.scale("probe", count, f"benchmark scale-up {count - 1}")
        if granted.wanted != count:
            sys.exit(f"ctl: asked probe={count}, granted {granted.wanted}")
        started = RUN_DIR / f"probe-{count - 1}.txt"
        deadline = time.monotonic() + 60
        while not started.exists() or not started.read_text().endswith("\n"):
            if time.monotonic() > deadline:
                sys.exit(f"ctl: probe {count - 1} did not begin within 60 s")
            time.sleep(0.002)
        with out.open("a") as log:
            log.write(f"{float(started.read_text()) - began:.4f}\n")


def probe() -> None:
    began = time.time()
    import torch  # noqa: F401 (what an actor of an RL job imports)

    me = convoy.role()
    (RUN_DIR / f"probe-{me.rank}.txt").write_text(f"{began:.6f}\n")
    while True:
        time.sleep(1.0)


def trainer(args: argparse.Namespace) -> None:
    import torch
    from roles_trainer import build, train

    ctx = convoy.init()
    _, model, optimizer, data = build(ctx.rank)
    ckpt = convoy.Checkpointer(model, optimizer, state={"data": data})
    start = ckpt.restore()
    train(RUN_DIR, ctx.rank, ctx.round_id, start, args, model, optimizer, data, ckpt.step)
    ckpt.close()
    torch.distributed.destroy_process_group()


def bystander() -> None:
    me = convoy.role()
    with (RUN_DIR / "bystander-starts.txt").open("a") as out:
        out.write(f"{me.rank} {me.incarnation}\n")
    while True:
        time.sleep(1.0)


def worker(args: argparse.Namespace) -> None:
    me = convoy.role()
    for shard in convoy.shards("units", num_samples=args.units, shard_size=1):
        time.sleep(args.unit_time)
        with (RUN_DIR / "units-done.txt").open("a") as out:
            out.write(f"{shard.start}\n")
        shard.done()
        if me.preempted:
            return


def preemptor(args: argparse.Namespace) -> None:
    from convoy.control.pool.store import PoolStore

    convoy.scale("worker", 4, "benchmark: every worker")
    for _ in range(args.preemptions):
        while convoy.roles()["worker"].running < 4:
            time.sleep(0.02)
        time.sleep(0.5)
        pool = PoolStore().view()
        cpus = min(pool.capacity.cpus, pool.free.cpus + 1)
        out = subprocess.run([sys.executable, "-m", "convoy", "preempt", "--cpus", f"{cpus:g}", "--priority", "10",
                              "--seconds", "1"], capture_output=True, text=True, check=True).stdout
        ended = time.monotonic()
        freed = re.search(r"free after ([\d.]+) s", out)
        if freed is None:
            sys.exit(f"preemptor: convoy preempt said {out!r}")
        while convoy.roles()["worker"].running < 4:
            time.sleep(0.02)
        with (RUN_DIR / "preemptions.txt").open("a") as log:
            log.write(f"{freed.group(1)} {time.monotonic() - ended:.3f}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale-ups", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-time", type=float, default=0.01)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--kill-every", type=int, default=30)
    parser.add_argument("--units", type=int, default=1200)
    parser.add_argument("--unit-time", type=float, default=0.05)
    parser.add_argument("--preemptions", type=int, default=5)
    args = parser.parse_args()
    name = convoy.role().name
    {"ctl": lambda: ctl(args), "probe": probe, "trainer": lambda: trainer(args), "bystander": bystander,
     "worker": lambda: worker(args), "preemptor": lambda: preemptor(args)}[name]()


if __name__ == "__main__":
    main()
