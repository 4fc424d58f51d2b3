"""The trainer both sides of ``benchmarks/roles.py`` part 2 run (the convoy role group and the torchrun peer): a
small DDP regression, its rank 1 SIGKILLing itself in the middle of step ``every * n`` for its n-th kill
(``RUN_DIR/kill-<n>.txt`` gets the step, the wall time and the round first), rank 0 logging each step it finishes
(``RUN_DIR/trainer-steps.txt``: ``round step finished-at``, and ``start round step at`` as each round begins)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel


def build(rank: int) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
    """(the module, its DDP wrapper, Adam, this rank's data stream)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = DistributedDataParallel(net)
    return net, model, torch.optim.Adam(model.parameters(), lr=0.01), torch.Generator().manual_seed(7 + rank)


def train(run_dir: Path, rank: int, round_id: int, start: int, args: Any, model: torch.nn.Module,
          optimizer: torch.optim.Optimizer, data: torch.Generator, after_step: Callable[[int], None]) -> None:
    """Steps ``start`` .. ``args.steps``; ``after_step`` saves the finished step (a snapshot, a file)."""
    log = (run_dir / "trainer-steps.txt").open("a") if rank == 0 else None
    if log is not None:
        log.write(f"start {round_id} {start} {time.time():.6f}\n")
        log.flush()
    for step in range(start, args.steps):
        inputs = torch.randn(64, 32, generator=data)
        loss = torch.nn.functional.mse_loss(model(inputs), inputs.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        killed = len(list(run_dir.glob("kill-*.txt")))
        if rank == 1 and killed < args.kills and step == args.kill_every * (killed + 1):
            (run_dir / f"kill-{killed + 1}.txt").write_text(f"{step} {time.time():.6f} {round_id}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        after_step(step)
        if log is not None:
            log.write(f"{round_id} {step} {time.time():.6f}\n")
            log.flush()
        time.sleep(args.step_time)
