"""The data and the model of the DLRM-style examples (``train_dlrm.py``, ``train_ps.py``): synthetic
Criteo-shaped samples whose labels come from a hidden teacher, and DLRM's dense arch (bottom MLP, pairwise
interaction, top MLP); the AUC that scores it. ``train_dlrm.py``'s docstring says how the data is drawn."""

from __future__ import annotations

import math
import zlib
from typing import NamedTuple

import torch
from torch import nn

from convoy.parallel.embedding.bags import Bags, TableSpec

CRITEO_ROWS = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
               5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
"""Distinct values of the 26 categorical features of Criteo's Kaggle display-advertising data."""

MULTI_HOT = {"C3": 4, "C7": 3, "C12": 4, "C22": 2}
"""Features whose bags hold 1 to this many ids (mean-pooled); the others hold one id each."""

DENSE = 13

CLICK_RATE = 0.25
"""About a quarter of Criteo's samples are clicks."""


class Batch(NamedTuple):
    dense: torch.Tensor
    features: dict[str, Bags]
    labels: torch.Tensor
    teacher: torch.Tensor


def seeded(*parts: object) -> torch.Generator:
    """A generator for one named stream, e.g. ``seeded("train", seed, rank, step)``."""
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))


def power_law_ranks(gen: torch.Generator, count: int, rows: int, exponent: float) -> torch.Tensor:
    """``count`` draws in ``0..rows-1``, rank ``k`` with probability about ``(k + 1) ** -exponent``
    (the inverse CDF of the continuous power law on ``[1, rows + 1)``)."""
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    if abs(exponent - 1.0) < 1e-9:
        x = torch.exp(u * math.log(rows + 1))
    else:
        e = 1.0 - exponent
        x = (1.0 - u + u * (rows + 1) ** e) ** (1.0 / e)
    return (x.floor().long() - 1).clamp_(0, rows - 1)


class Synthetic:
    """The data's fixed definition: feature distributions and the hidden teacher that labels them.
    Every rank builds the same one from ``seed``."""

    def __init__(self, specs: list[TableSpec], seed: int, zipf: float) -> None:
        gen = seeded("teacher", seed)
        self.specs, self.zipf = specs, zipf
        self.mu = torch.rand(DENSE, generator=gen) * 4  # log of a typical count
        self.sigma = 0.5 + torch.rand(DENSE, generator=gen)
        self.dense_weight = torch.randn(DENSE, generator=gen) * 0.3
        self.popular = {}  # popularity rank -> row, so hot rows are spread over the table
        self.score = {}  # each row's hidden contribution to the logit
        for spec in specs:
            self.popular[spec.name] = torch.randperm(spec.num_rows, generator=gen)
            scale = 0.2 + 0.6 * torch.rand((), generator=gen)
            self.score[spec.name] = torch.randn(spec.num_rows, generator=gen) * scale
        self.bias = 0.0
        self.bias = self.calibrate(gen, CLICK_RATE)

    def calibrate(self, gen: torch.Generator, rate: float, count: int = 8192) -> float:
        """The bias that makes ``rate`` of the labels clicks (by bisection on a sample)."""
        logits = self.draw(gen, count).teacher
        low, high = -20.0, 20.0
        for _ in range(50):
            middle = (low + high) / 2
            low, high = (middle, high) if torch.sigmoid(logits + middle).mean().item() < rate else (low, middle)
        return (low + high) / 2

    def draw(self, gen: torch.Generator, count: int) -> Batch:
        """``count`` samples: dense features (after log1p), one bag per sparse feature, labels, and the
        teacher's logits (the best any model can predict)."""
        counts = torch.exp(self.mu + self.sigma * torch.randn(count, DENSE, generator=gen)).floor()
        dense = torch.log1p(counts)
        logit = self.bias + ((dense - self.mu) / self.sigma) @ self.dense_weight
        features = {}
        for spec in self.specs:
            most = MULTI_HOT.get(spec.name, 1)
            lengths = torch.randint(1, most + 1, (count,), generator=gen)
            ids = self.popular[spec.name][power_law_ranks(gen, int(lengths.sum()), spec.num_rows, self.zipf)]
            offsets = torch.zeros(count, dtype=torch.int64)
            offsets[1:] = lengths.cumsum(0)[:-1]
            bag = torch.repeat_interleave(torch.arange(count), lengths)
            logit += torch.zeros(count).index_add_(0, bag, self.score[spec.name][ids]) / lengths
            features[spec.name] = Bags(ids, offsets)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        return Batch(dense, features, labels, logit)


def take(batch: Batch, lo: int, hi: int) -> Batch:
    """Samples ``lo..hi-1`` of a batch (``lo < hi``)."""
    part = {}
    for name, (ids, offsets, _) in batch.features.items():
        start = int(offsets[lo])
        end = int(offsets[hi]) if hi < len(offsets) else len(ids)
        part[name] = Bags(ids[start:end], offsets[lo:hi] - start)
    return Batch(batch.dense[lo:hi], part, batch.labels[lo:hi], batch.teacher[lo:hi])


def mlp(sizes: list[int], relu_last: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(fan_in, fan_out))
        if relu_last or index < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseArch(nn.Module):
    """Bottom MLP, pairwise dot-product interaction, top MLP: everything of DLRM but the tables."""

    def __init__(self, dim: int, features: int, bottom: list[int], top: list[int]) -> None:
        super().__init__()
        vectors = features + 1
        self.bottom = mlp([DENSE, *bottom, dim], relu_last=True)
        self.top = mlp([vectors * (vectors - 1) // 2 + dim, *top, 1], relu_last=False)
        self.pairs = torch.triu_indices(vectors, vectors, offset=1)  # a constant, not a buffer DDP would sync

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """``dense`` (batch, 13) and ``pooled`` (batch, 26, dim) -> logits (batch,)."""
        bottom = self.bottom(dense)
        vectors = torch.cat([bottom.unsqueeze(1), pooled], 1)
        dots = vectors @ vectors.transpose(1, 2)
        interactions = dots[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([bottom, interactions], 1)).squeeze(1)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve by the Mann-Whitney U statistic (tied scores get their mean rank)."""
    order = torch.argsort(scores)
    _, group, sizes = torch.unique_consecutive(scores[order], return_inverse=True, return_counts=True)
    ends = sizes.cumsum(0).double()
    mean_rank = ends - (sizes.double() - 1) / 2  # 1-based ranks of a tie group, averaged
    ranks = torch.empty(len(scores), dtype=torch.float64)
    ranks[order] = mean_rank[group]
    positive = labels > 0.5
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return (ranks[positive].sum().item() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
