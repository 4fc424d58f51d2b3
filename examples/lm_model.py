"""The data and the model of ``train_local_sgd.py``: a byte-level corpus (the Python standard library's own
sources, no download), a held-out split of it, and a small causal transformer cut into stages (embedding,
blocks, head) with its loss, training windows and held-out loss."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


def corpus(limit: int) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's sources, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    text = b"".join(chunks)[:limit]
    if len(text) < limit // 2:
        raise SystemExit(f"found only {len(text)} bytes of Python sources under {root}; need about {limit}")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def split_corpus(data: torch.Tensor, block: int = 8192, every: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``every``-th block of ``block`` bytes is held out, so both parts cover every file kind."""
    blocks = list(data.split(block))
    held = [b for i, b in enumerate(blocks) if i % every == every - 1]
    return torch.cat([b for i, b in enumerate(blocks) if i % every != every - 1]), torch.cat(held)


class Embed(nn.Module):
    def __init__(self, width: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Parameter(torch.randn(context, width) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_model(width: int, layers: int, heads: int, context: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)  # every replica starts from the same weights
    return nn.Sequential(Embed(width, context), *[Block(width, heads) for _ in range(layers)], Head(width))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def windows(data: torch.Tensor, count: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - context - 1, (count,), generator=gen)
    rows = torch.stack([data[s: s + context + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def held_out_loss(model: nn.Sequential, data: torch.Tensor, context: int, batches: int) -> float:
    gen = torch.Generator().manual_seed(12345)
    losses = [lm_loss(model(x), y).item() for x, y in (windows(data, 32, context, gen) for _ in range(batches))]
    return sum(losses) / len(losses)
