"""A small causal transformer trained with sequence parallelism of degree 4 (query broadcast).

    convoy run --nproc-per-node 4 examples/train_sequence_parallel.py --steps 150

The task needs attention across ranks: each sequence is random tokens followed by the same
tokens again, so the second half can only be predicted by looking back half a sequence, into
the parts other ranks hold. Every rank holds a quarter of every sequence; parameters are
replicated and their gradients summed over the ranks. The loss of the copied half falls from
about ln(vocab) to near zero; ``--scheme`` picks another exact scheme for comparison.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import convoy
from convoy.parallel.sequence.query_broadcast import SCHEMES, SequenceParallelAttention, shard_sequence


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, scheme: str, micro: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = SequenceParallelAttention(width, heads, kv_heads, causal=True, scheme=scheme, micro=micro)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, length: int, width: int, layers: int, scheme: str, micro: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, 4, 2, scheme, micro) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(positions)  # global positions of this rank's part
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64, help="whole sequence length (a multiple of the ranks)")
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--scheme", choices=SCHEMES, default="query_broadcast")
    parser.add_argument("--micro", type=int, default=2, help="query micro-sequences per rank and round")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    model = TinyLM(args.vocab, args.length, 64, 2, args.scheme, args.micro)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)  # the same batches on every rank; each keeps its part
    half = args.length // 2
    positions = shard_sequence(torch.arange(args.length), 0, rank, world)
    start, first = time.perf_counter(), None
    for step in range(1, args.steps + 1):
        prefix = torch.randint(0, args.vocab, (args.batch, half), generator=data)
        tokens = torch.cat([prefix, prefix], dim=1)
        inputs = shard_sequence(tokens, 1, rank, world)
        targets = shard_sequence(torch.roll(tokens, -1, dims=1), 1, rank, world)
        scored = (positions >= half) & (positions < args.length - 1)  # the copied half is predictable
        logits = model(inputs, positions)
        loss_sum = nn.functional.cross_entropy(logits[:, scored].reshape(-1, args.vocab),
                                               targets[:, scored].reshape(-1), reduction="sum")
        count = args.batch * (args.length - 1 - half)
        opt.zero_grad()
        (loss_sum / count).backward()
        for p in model.parameters():  # each rank holds part of the loss: gradients add up
            dist.all_reduce(p.grad)
        opt.step()
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        loss = float(total) / count
        first = loss if first is None else first
        if rank == 0 and (step % 25 == 0 or step == 1):
            print(f"step {step:4d}  copy loss {loss:.4f}  ({time.perf_counter() - start:.1f} s)", flush=True)
    if rank == 0:
        print(f"{args.scheme}, {world} ranks x {args.length // world} positions: copy loss {first:.3f} -> {loss:.3f} "
              f"(chance {math.log(args.vocab):.3f})", flush=True)
    dist.barrier()
    convoy.exit_without_teardown()


if __name__ == "__main__":
    main()
