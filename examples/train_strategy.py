"""A causal transformer trained with the strategy ``convoy plan`` picked for it.

    convoy plan --nodes 2 --nproc-per-node 2 --memory 1.5GB examples/train_strategy.py
    convoy run --nnodes 2 --nproc-per-node 2 examples/train_strategy.py --steps 20

``workload()`` is what ``convoy plan`` builds the model, optimizer and batches from (it imports this
file; the ``__main__`` block does not run then). Data: random token sequences whose next token is a
fixed function of the current one, so the loss falls. The default model has about 20 M parameters.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import convoy
from convoy.strategy import Workload


def options(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--strategy", default="auto", help="auto (the planned file), or a strategy file's path")
    return parser.parse_known_args(argv)[0]


class Attention(nn.Module):
    """Causal self-attention through ``convoy.attention`` (so the sequence strategy can cut its positions)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        return self.out(convoy.attention(q, k, v, causal=True).transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embed(nn.Module):
    """The first of the layers a pipeline cuts into stages: token and position embeddings (``convoy.positions``:
    where the sequence strategy cuts the positions, this rank's part's)."""

    def __init__(self, embed: nn.Embedding, position: nn.Embedding) -> None:
        super().__init__()
        self.embed, self.position = embed, position

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.position(convoy.positions(tokens.shape[1], tokens.device))


class Transformer(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = Embed(self.embed, self.position)(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def pipeline_layers(self) -> list[nn.Module]:
        """The layers in order, for the pipeline strategy (they are this model's own modules)."""
        return [Embed(self.embed, self.position), *self.blocks, nn.Sequential(self.norm, self.head)]


def workload(argv: list[str] | None = None) -> Workload:
    args = options(sys.argv[1:] if argv is None else argv)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return Transformer(args.vocab, args.width, args.layers, args.heads, args.context)

    def batch(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, args.vocab, (samples, 1), generator=gen)
        tokens = (start + 7 * torch.arange(args.context + 1)) % args.vocab
        return tokens[:, :-1], tokens[:, 1:]

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    return Workload(model=model, optimizer=lambda params: torch.optim.Adam(params, lr=3e-4), batch=batch,
                    loss=loss, batch_size=args.batch)


def main() -> None:
    args = options(sys.argv[1:])
    job = workload()
    ctx = convoy.init()
    model = job.model()
    model, optimizer = convoy.accelerate(model, job.optimizer(model.parameters()), strategy=args.strategy)
    if ctx.rank == 0:
        print(f"strategy: {model.convoy_strategy.name()}", flush=True)
    for step in range(args.steps):
        start = time.perf_counter()
        inputs, targets = job.batch(args.batch, 1000 * step + ctx.rank)
        loss = convoy.train_step(model, optimizer, job.loss, inputs, targets)
        if ctx.rank == 0:
            print(f"step {step} loss {loss:.4f} {time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
