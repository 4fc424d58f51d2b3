"""A torchrun script's first moments: import torch, join the process group from the launcher's variables
(env://), wrap a small model in DistributedDataParallel and take one step (its gradients' all_reduce); rank 0
then writes the wall-clock time to ``--out`` (``torchrun_lines.py`` times it)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 32)).square().mean().backward()
    optimizer.step()
    if dist.get_rank() == 0:
        Path(args.out).write_text(f"{time.time():.6f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
