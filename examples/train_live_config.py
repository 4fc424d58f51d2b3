"""A DDP job whose training config changes while it runs (synthetic regression, bit-reproducible).

    convoy run --nnodes 2 --nproc-per-node 2 --set lr=0.02 examples/train_live_config.py
    convoy config set --run-dir RUN_DIR lr=0.005            # in place, at one step on every rank
    convoy config set --run-dir RUN_DIR batch_size=64       # by a restart from that step's snapshot
    convoy config set --run-dir RUN_DIR steps=500           # a longer (or shorter) run

Every rank reports its loss each step (``convoy.report``) and writes one line per step to ``--log-dir``
(``step lr batch_size loss round started``), so that which step each rank switched at can be checked afterwards.
Gradients are averaged by one all_reduce in a fixed order, so the same config at the same steps gives the same bits.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import convoy


@dataclass
class Config:
    lr: float = convoy.hot(0.01, min=0.0, max=100.0, doc="Adam's learning rate")
    clip: float = convoy.hot(0.0, min=0.0, doc="gradient norm clip (0: none)")
    crash_above_lr: float = convoy.hot(0.0, min=0.0, doc="raise when lr is above this (0: never); tests the revert")
    steps: int = convoy.hot(300, min=1, doc="steps to train (the run ends at the first step at or past it)")
    batch_size: int = convoy.restart(32, min=1, max=4096, doc="samples per rank and step")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step, to slow the job down")
    parser.add_argument("--persist-every", type=int, default=0, help="persistent checkpoint every N steps (0: never)")
    parser.add_argument("--log-dir", default="", help="one file per rank: step lr batch_size loss")
    parser.add_argument("--out", default="", help="write the final parameters here (rank 0)")
    args = parser.parse_args()

    ctx = convoy.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(net.parameters())
    data = torch.Generator().manual_seed(1000 + ctx.rank)
    true_weights = torch.linspace(-1, 1, 16)
    ckpt = convoy.Checkpointer(net, optimizer, state={"data": data}, persist_every=args.persist_every,
                               replicated=True)
    start = ckpt.restore()
    cfg = convoy.train_config(Config, step=start)  # the values step `start` runs with
    log = open(Path(args.log_dir) / f"rank{ctx.rank}.log", "a") if args.log_dir else None  # noqa: SIM115
    step = start
    while step < cfg.steps:
        if cfg.crash_above_lr and cfg.lr > cfg.crash_above_lr:
            raise RuntimeError(f"lr {cfg.lr} is above {cfg.crash_above_lr}: this config makes the worker fail")
        started = time.time()
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr
        inputs = torch.randn(cfg.batch_size, 16, generator=data)
        targets = (inputs @ true_weights).unsqueeze(1) + 0.01 * torch.randn(cfg.batch_size, 1, generator=data)
        loss = torch.nn.functional.mse_loss(net(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad for p in net.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= ctx.world_size
        torch.nn.utils.vector_to_parameters(flat, grads)
        if cfg.clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.clip)
        optimizer.step()
        ckpt.step(step)
        value = loss.item()
        if log is not None:
            log.write(f"{step} {cfg.lr!r} {cfg.batch_size} {value!r} {ctx.round_id} {started!r}\n")
            log.flush()
        convoy.report(step, loss=value if math.isfinite(value) else float("nan"), samples=cfg.batch_size)
        if args.step_time:
            time.sleep(args.step_time)
        step += 1
    ckpt.close()
    if args.out and ctx.rank == 0:
        torch.save({name: tensor.clone() for name, tensor in net.state_dict().items()}, args.out)
    if ctx.rank == 0:
        print(f"finished {step} steps, lr {cfg.lr}, batch {cfg.batch_size}", flush=True)


if __name__ == "__main__":
    main()
