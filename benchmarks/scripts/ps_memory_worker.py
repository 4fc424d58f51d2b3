"""One measured process of the memory-prediction benchmark (benchmarks/scripts/ps_predict.py): a click model of
one embedding table (``nn.EmbeddingBag(sparse=True)``, Adagrad) and an MLP (Adam) trained on synthetic batches.

    python ps_memory_worker.py --rows R --dim D --hidden 512,256 --batch B --iterations N [--handshake]

With ``--handshake`` it stops at the points the sizing method measures, prints a line and waits for one on
stdin: ``baseline`` (interpreter, imports and the data pipeline ready, no model yet), then ``start I`` and
``end I`` around iteration ``I``. Without it, it just trains. The last line is its iteration shape as JSON
(state bytes: parameters, gradients and optimizer state; bytes per sample).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

DENSE, HOT = 13, 4


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--hidden", default="256,128")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--handshake", action="store_true")
    return parser.parse_args()


def say(line: str, wait: bool) -> None:
    if wait:
        print(line, flush=True)
        if sys.stdin.readline().strip() != "go":
            raise SystemExit(f"expected 'go' after {line!r}")


class Clicks(nn.Module):
    def __init__(self, rows: int, dim: int, hidden: list[int]) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        sizes = [DENSE + dim, *hidden, 1]
        layers: list[nn.Module] = []
        for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(fan_in, fan_out))
            if index < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.mlp = nn.Sequential(*layers)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([dense, self.table(ids, offsets)], 1)).squeeze(1)


def batch_of(gen: torch.Generator, rows: int, size: int) -> tuple[torch.Tensor, ...]:
    dense = torch.randn(size, DENSE, generator=gen)
    ids = (torch.rand(size * HOT, generator=gen).pow(3) * rows).long().clamp_(max=rows - 1)
    offsets = torch.arange(0, size * HOT, HOT)
    labels = (torch.rand(size, generator=gen) < 0.25).float()
    return dense, ids, offsets, labels


def main() -> int:
    args = parse()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch's Adagrad on sparse gradients
    hidden = [int(w) for w in args.hidden.split(",") if w]
    gen = torch.Generator().manual_seed(0)
    batch_of(gen, args.rows, 2)  # the data pipeline has run once: its code is loaded
    say("baseline", args.handshake)
    torch.manual_seed(0)
    model = Clicks(args.rows, args.dim, hidden)
    dense_opt = torch.optim.Adam(model.mlp.parameters(), lr=1e-3)
    sparse_opt = torch.optim.Adagrad(model.table.parameters(), lr=0.05)
    table = model.table.weight.numel()
    mlp = sum(p.numel() for p in model.mlp.parameters())
    for step in range(args.iterations):
        say(f"start {step}", args.handshake)
        dense, ids, offsets, labels = batch_of(gen, args.rows, args.batch)
        loss = F.binary_cross_entropy_with_logits(model(dense, ids, offsets), labels)
        dense_opt.zero_grad()
        sparse_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        sparse_opt.step()
        say(f"end {step}", args.handshake)
    print(json.dumps({"params": table + mlp, "state_bytes": 4 * (2 * table + 4 * mlp),
                      "sample_bytes": 4 * (DENSE + 1) + 8 * (HOT + 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
