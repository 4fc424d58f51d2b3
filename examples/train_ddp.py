"""A small real DDP training job (synthetic regression) that resumes exactly after a failure.

    convoy run --nnodes 2 --nproc-per-node 2 examples/train_ddp.py --steps 40 --kill-rank 3 --kill-at-step 20

``--kill-rank R --kill-at-step K`` makes rank R SIGKILL itself in the middle of step K in the
job's first attempt only, to show a restart that resumes at step K (the step after the last
finished one) from the in-memory snapshot. Runs under torchrun too (persistent checkpoints only).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import convoy


def average_gradients(net: torch.nn.Module, world_size: int) -> None:
    """DDP's job without DDP: one all_reduce over all gradients, always in the same layout."""
    grads = [p.grad for p in net.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= world_size
    torch.nn.utils.vector_to_parameters(flat, grads)


def told_to_end(path: str, rank: int) -> bool:
    """Whether rank 0 sees ``path``; every rank gets rank 0's answer, so all end after the same step."""
    seen = torch.tensor([rank == 0 and os.path.exists(path)], dtype=torch.int32)
    torch.distributed.broadcast(seen, src=0)
    return bool(seen.item())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step, to slow the job down")
    parser.add_argument("--persist-every", type=int, default=10, help="persistent checkpoint every N steps (0: never)")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--until", default="", help="end after the step in which this file appears (rank 0 "
                        "looks, every rank stops at the same step), before --steps if it comes first")
    parser.add_argument("--out", default="", help="write the final parameters here (rank 0)")
    parser.add_argument("--grad-sync", choices=["ddp", "allreduce"], default="ddp",
                        help="DDP, or one all_reduce of all gradients in a fixed order (bit-reproducible)")
    args = parser.parse_args()

    ctx = convoy.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = DistributedDataParallel(net) if args.grad_sync == "ddp" else net
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1000 + ctx.rank)  # this rank's data stream; its position is checkpointed
    true_weights = torch.linspace(-1, 1, 16)
    # replicated either way (DDP, or the same all_reduce of every gradient): a rank whose last snapshot was still
    # landing when it died takes that step's model from a peer and keeps its own data position
    ckpt = convoy.Checkpointer(model, optimizer, state={"data": data}, persist_every=args.persist_every,
                               replicated=True)
    start = ckpt.restore()
    if ctx.rank == 0:
        print(f"starting at step {start} (round {ctx.round_id}, world size {ctx.world_size}, "
              f"restored from {ckpt.restored_from})", flush=True)
    for step in range(start, args.steps):
        inputs = torch.randn(args.batch, 16, generator=data)
        targets = (inputs @ true_weights).unsqueeze(1) + 0.01 * torch.randn(args.batch, 1, generator=data)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        if args.grad_sync == "allreduce":
            average_gradients(net, ctx.world_size)
        if ctx.restart_count == 0 and ctx.rank == args.kill_rank and step == args.kill_at_step:
            print(f"killing myself (rank {ctx.rank}) with SIGKILL in the middle of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        ckpt.step(step)
        if args.step_time:
            time.sleep(args.step_time)
        last = step == args.steps - 1 or (bool(args.until) and told_to_end(args.until, ctx.rank))
        if ctx.rank == 0 and (step % 5 == 0 or last):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if last:
            break
    ckpt.close()
    if args.out and ctx.rank == 0:
        torch.save(net.state_dict(), args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
