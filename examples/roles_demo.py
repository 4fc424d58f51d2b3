"""A job of three roles on the roles runtime, in under a minute (``examples/roles_demo.toml``):

    convoy run examples/roles_demo.toml

- ``trainer`` (``group = true``, 2 processes): a torch.distributed world of its own (RANK, WORLD_SIZE and
  MASTER_* of the role), DDP on a small regression, an in-memory snapshot after every step. With
  ``--kill-trainer-at STEP`` its rank 1 SIGKILLs itself once at that step: the group forms again in a new
  round of the role from the members' snapshots, no finished step is lost, and no other role restarts.
- ``echo`` (``service = true``, 1 to 3 processes): stands for a service such as a replay buffer; it serves
  until every other role has finished, then is stopped.
- ``worker`` (1 to 4 processes of 0.5 CPU each, elastic): takes units of work from a shard queue
  (``convoy.shards``) and checks ``convoy.role().preempted`` between units.
- ``controller`` (1 process, ``after = ["echo"]``): scales ``echo`` up and down from inside the job with
  ``convoy.scale`` and sees each change with ``convoy.role().wait_changed``; then runs ``convoy preempt`` for a job
  of priority 10 that needs one CPU more than the pool has free: this job's workers give CPUs back (each finishes
  its unit, then exits), and grow back to 4 once the preempting job is gone.

Every step the trainers finish is appended to ``RUN_DIR/trained-steps.txt``, every unit a worker finishes to
``RUN_DIR/units-done.txt``; the trainer and the last worker count them.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import convoy
from convoy.errors import ConfigError


def train(args: argparse.Namespace) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    ctx = convoy.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + ctx.rank)
    ckpt = convoy.Checkpointer(model, optimizer, state={"data": data})
    start = ckpt.restore()
    if ctx.rank == 0:
        print(f"trainer group round {ctx.round_id}: world size {ctx.world_size}, starting at step {start} "
              f"(restored from {ckpt.restored_from})", flush=True)
    log = Path(ctx.run_dir) / "trained-steps.txt"
    truth = torch.linspace(-1, 1, 16)
    for step in range(start, args.steps):
        inputs = torch.randn(32, 16, generator=data)
        loss = torch.nn.functional.mse_loss(model(inputs), (inputs @ truth).unsqueeze(1))
        optimizer.zero_grad()
        loss.backward()
        if ctx.rank == 1 and step == args.kill_trainer_at and ctx.restart_count == 0:
            print(f"trainer 1: SIGKILL in the middle of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        ckpt.step(step)
        if ctx.rank == 0:
            with log.open("a") as out:
                out.write(f"{step}\n")
            if step % 20 == 0:
                print(f"trainer: step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(args.step_time)
    ckpt.close()
    if ctx.rank == 0:
        done = [int(line) for line in log.read_text().split()]
        lost = sorted(set(range(args.steps)) - set(done))
        print(f"trainer: {len(set(done))} of {args.steps} steps trained, {len(done) - len(set(done))} redone after a "
              f"failure, {len(lost)} lost", flush=True)
    torch.distributed.destroy_process_group()


def echo() -> None:
    """A service stand-in: it holds its port and waits to be stopped (SIGTERM's default ends it)."""
    me = convoy.role()
    print(f"echo {me.rank}: serving at port {os.environ.get('CONVOY_ROLE_PORT')}", flush=True)
    while True:
        time.sleep(1.0)


def work(args: argparse.Namespace) -> None:
    """Units of work from the job's shard queue; a preempted worker finishes its unit, then exits 0."""
    me = convoy.role()
    done = Path(os.environ["CONVOY_RUN_DIR"]) / "units-done.txt"
    for shard in convoy.shards("units", num_samples=args.units, shard_size=1):
        time.sleep(args.unit_time)  # the unit's work
        with done.open("a") as out:
            out.write(f"{shard.start}\n")
        shard.done()
        if me.preempted:
            print(f"worker {me.rank}: preempted; unit {shard.start} finished, exiting", flush=True)
            return
    units = [int(line) for line in done.read_text().split()]
    print(f"worker {me.rank}: no units left; {len(set(units))} of {args.units} done, "
          f"{len(units) - len(set(units))} twice, {args.units - len(set(units))} lost", flush=True)


def preempt_once() -> None:
    """A job of priority 10 that needs one CPU more than the pool has free, for 2 s (``convoy preempt``)."""
    from convoy.control.pool.store import PoolStore

    view = PoolStore().view()
    cpus = min(view.capacity.cpus, view.free.cpus + 1.0)
    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "convoy", "preempt", "--cpus", f"{cpus:g}", "--priority", "10",
                    "--seconds", "2"], check=True)
    ended = time.monotonic()
    while convoy.roles()["worker"].running < 4:
        if time.monotonic() - ended > 30:
            sys.exit("controller: the workers did not grow back to 4 within 30 s")
        time.sleep(0.05)
    print(f"controller: the preempting job took {ended - began:.1f} s; worker back at 4 processes "
          f"{time.monotonic() - ended:.2f} s after it ended", flush=True)


def control(args: argparse.Namespace) -> None:
    me = convoy.role()
    try:
        convoy.scale("echo", 4, "demo: beyond its MAX")
    except ConfigError as exc:
        print(f"controller: convoy.scale('echo', 4) refused: {exc}", flush=True)
    for count, why in ((3, "demo: more load on echo"), (1, "demo: the load is gone")):
        granted = convoy.scale("echo", count, why)
        print(f"controller: asked echo={count}: granted {granted.wanted} ({granted.running} running)", flush=True)
        deadline = time.monotonic() + 30
        while len([a for a in me.addresses.get("echo", ()) if a]) != count:
            changed = me.wait_changed(timeout=max(0.0, deadline - time.monotonic()))
            if changed is None:
                sys.exit(f"controller: echo did not reach {count} processes within 30 s")
            me = changed
        print(f"controller: echo runs {count} process(es): {', '.join(me.addresses['echo'])}", flush=True)
    counts = convoy.roles()
    print("controller: " + ", ".join(f"{name} {c.running}/{c.wanted}" for name, c in counts.items()), flush=True)
    convoy.scale("worker", 4, "demo: every worker, 2 CPUs of the pool")
    while convoy.roles()["worker"].running < 4:  # every worker started: there is something to preempt
        time.sleep(0.05)
    preempt_once()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--kill-trainer-at", type=int, default=-1, help="trainer 1 SIGKILLs itself once here")
    parser.add_argument("--units", type=int, default=400)
    parser.add_argument("--unit-time", type=float, default=0.05)
    args = parser.parse_args()
    name = convoy.role().name
    {"trainer": lambda: train(args), "echo": echo, "controller": lambda: control(args),
     "worker": lambda: work(args)}[name]()


if __name__ == "__main__":
    main()
