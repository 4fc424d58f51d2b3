"""The seeded DDP job of benchmarks/faults.py: resumes at the step after the last finished one.

After each finished step (``ckpt.step(step)`` returned) every rank appends
``rank step pid time round`` to OUT/rank{RANK}.txt, flushed, so the benchmark can tell from
the files which steps finished when, and where each restarted worker resumed. The job ends
at ``--steps``, or earlier at the step written to OUT/stop_at by the benchmark (each rank
reads it before every step, and the benchmark picks a step no rank has reached yet).
``--hidden`` widens the model (the full-/dev/shm fault needs one whose snapshots do not fit) and
``--persist-every`` turns on persistent saves.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import convoy


def stop_step(path: Path) -> int | None:
    """The step the benchmark asked the job to end at, once it has asked."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory for the per-rank step files and stop_at")
    parser.add_argument("--steps", type=int, default=3000, help="the most steps the job runs")
    parser.add_argument("--sleep", type=float, default=0.05, help="seconds of 'data loading' per step")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--hidden", type=int, default=64, help="width of the model's hidden layer")
    parser.add_argument("--persist-every", type=int, default=0, help="steps between persistent saves (0: none)")
    args = parser.parse_args()
    ctx = convoy.init()
    torch.manual_seed(args.seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, args.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(args.hidden, 1))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(args.seed * 1000 + ctx.rank)
    ckpt = convoy.Checkpointer(model, optimizer, state={"data": data}, every=1,
                               persist_every=args.persist_every)
    start = ckpt.restore()
    print(f"rank {ctx.rank} of {ctx.world_size}, round {ctx.round_id}: starting at step {start} "
          f"(restored from {ckpt.restored_from})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stop_file, stop_at = out / "stop_at", None
    with open(out / f"rank{ctx.rank}.txt", "a") as record:
        for step in range(start, args.steps):
            stop_at = stop_at if stop_at is not None else stop_step(stop_file)
            if stop_at is not None and step >= stop_at:
                break
            time.sleep(args.sleep)
            inputs = torch.randn(32, 32, generator=data)
            loss = (model(inputs) - inputs[:, :1]).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt.step(step)
            record.write(f"{ctx.rank} {step} {os.getpid()} {time.time():.6f} {ctx.round_id}\n")
            record.flush()
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
