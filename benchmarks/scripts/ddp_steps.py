"""A small gloo DDP job for benchmarks/launch.py; runs unchanged under convoy and torchrun.

After each finished step every rank appends ``rank step pid time restart`` to OUT/rank{RANK}.txt
(flushed), so the benchmark can time starts and restarts from files. No checkpoint: a restarted
job begins again at step 0.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory for the per-rank step files")
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--sleep", type=float, default=0.05, help="seconds of 'data loading' per step")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = DistributedDataParallel(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.txt"), "a") as out:
        for step in range(args.steps):
            time.sleep(args.sleep)
            x = torch.randn(32, 64)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()  # the gradient allreduce: a step finishes only when every rank takes part
            optimizer.step()
            out.write(f"{rank} {step} {os.getpid()} {time.time():.6f} {restart}\n")
            out.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
