"""A small real DDP training job (synthetic regression), runnable under convoy or torchrun unchanged.

    convoy run --nnodes 2 --nproc-per-node 2 examples/train_ddp.py --steps 40 --kill-rank 3 --kill-at-step 15

``--kill-rank R --kill-at-step K`` makes rank R SIGKILL itself at step K in the job's first
attempt only (TORCHELASTIC_RESTART_COUNT == 0), to show a restart.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step, to slow the job down")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at-step", type=int, default=-1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    true_weights = torch.linspace(-1, 1, 16)
    generator = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        if attempt == 0 and rank == args.kill_rank and step == args.kill_at_step:
            print(f"killing myself (rank {rank}) with SIGKILL at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        inputs = torch.randn(args.batch, 16, generator=generator)
        targets = (inputs @ true_weights).unsqueeze(1) + 0.01 * torch.randn(args.batch, 1, generator=generator)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.step_time:
            time.sleep(args.step_time)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f} (world size {world}, attempt {attempt})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
