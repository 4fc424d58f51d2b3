"""A DLRM-style click model on synthetic Criteo-shaped data, its embedding tables sharded over the ranks.

    convoy run --nproc-per-node 4 examples/train_dlrm.py

Data: 13 dense features (log-normal counts, fed to the model as ``log1p``) and 26 sparse ones
whose tables have Criteo's (Kaggle) sizes, each capped at ``--rows``: a few large tables, many
small ones. Ids are drawn from a power law (``--zipf``) over a fixed shuffle of each table's
rows; a few features are multi-hot (bags of 1 to 4 ids, mean-pooled). Labels come from a fixed
hidden teacher: a random score per row of every table (averaged over a bag), plus a linear
function of the dense features, plus a bias that makes about a quarter of them clicks, through
a sigmoid, then a coin flip; so a model can learn them and the held-out AUC rises well above
0.5. Every rank draws its own batch each step (its seed depends on the rank and the step); the
held-out set is one fixed draw, each rank scores a slice of it and rank 0 computes the AUC over
all of it.

Model (as DLRM): a bottom MLP maps the dense features to ``--dim``; the interaction is the dot
product of every pair of the 27 vectors (26 pooled embeddings and the bottom output),
concatenated with the bottom output; a top MLP gives the logit (binary cross-entropy). The MLPs
are replicated under DDP (Adam); the tables live in one ``ShardedEmbeddingBagCollection``
(row-wise Adagrad), each rank holding about 1/world of their rows: large tables split by rows,
small ones whole on one rank (``--sharding row``: every table with at least a row per rank
split by rows).

Rank 0 prints the training loss (averaged over the ranks and the steps since the last line)
every ``--log-every`` steps, then the held-out AUC and log loss, each rank's table memory next to
the size of the tables replicated, and the time per step; ``--out FILE`` writes them as JSON.
Every step is snapshotted in memory (``convoy.Checkpointer``: each rank's rows and Adagrad
state, the MLPs, Adam); under convoy a failed worker resumes at the step after the last finished
one (``--kill-rank R --kill-at-step K`` shows it). Runs under torchrun, or as a plain one-process
job, too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import convoy
from convoy.errors import ConfigError, ConvoyError
from convoy.parallel.embedding.bags import Bags, ShardedEmbeddingBagCollection, TableSpec
from convoy.parallel.embedding.sparse_optim import SparseRowWiseAdagrad

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


def table_specs(args: argparse.Namespace, world: int) -> list[TableSpec]:
    specs = []
    for index, size in enumerate(CRITEO_ROWS):
        name, rows = f"C{index + 1}", min(size, args.rows)
        sharding = "row" if args.sharding == "row" and rows >= world else "auto"
        pooling = "mean" if name in MULTI_HOT else "sum"
        specs.append(TableSpec(name, rows, args.dim, pooling, sharding))
    return specs


def widths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer widths, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer widths >= 1, got {text!r}")
    return values


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256, help="samples per rank and step")
    parser.add_argument("--dim", type=int, default=16, help="width of every embedding (and the bottom MLP's output)")
    parser.add_argument("--rows", type=int, default=100_000, help="cap on the rows of a table (Criteo's largest: 10M)")
    parser.add_argument("--zipf", type=float, default=1.05, help="power-law exponent of the id draws")
    parser.add_argument("--sharding", choices=["auto", "row"], default="auto",
                        help="auto: small tables whole on one rank, the rest by rows; row: every table with at "
                             "least a row per rank by rows")
    parser.add_argument("--bottom", type=widths, default=[64], help="hidden widths of the bottom MLP")
    parser.add_argument("--top", type=widths, default=[128, 64], help="hidden widths of the top MLP")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate for the MLPs")
    parser.add_argument("--sparse-lr", type=float, default=0.05, help="row-wise Adagrad's learning rate for the tables")
    parser.add_argument("--eval-size", type=int, default=16384, help="held-out samples (split over the ranks)")
    parser.add_argument("--seed", type=int, default=0, help="the data's teacher, the initial weights, the batches")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--out", default="", help="rank 0 writes the results here (JSON)")
    parser.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself in the first attempt ...")
    parser.add_argument("--kill-at-step", type=int, default=-1, help="... in the middle of this step")
    args = parser.parse_args()
    for name in ("steps", "batch", "dim", "rows", "eval_size", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if not args.lr > 0 or not args.sparse_lr > 0 or not args.zipf > 0:
        parser.error("--lr, --sparse-lr and --zipf must be > 0")
    return args


def main() -> int:
    args = parse()
    torch.set_num_threads(int(os.environ.get("CONVOY_THREADS", "1")))
    ctx = convoy.init(backend="gloo")  # the sharded tables and their all-to-alls are on the CPU
    rank, world = ctx.rank, ctx.world_size
    if args.eval_size < world:
        raise ConfigError(f"--eval-size {args.eval_size} is less than the world size {world}; "
                          "every rank scores a slice of the held-out set")
    specs = table_specs(args, world)
    data = Synthetic(specs, args.seed, args.zipf)
    tables = ShardedEmbeddingBagCollection(specs, seed=args.seed)
    torch.manual_seed(args.seed)  # the same MLPs everywhere (DDP broadcasts rank 0's anyway)
    dense_arch = DenseArch(args.dim, len(specs), args.bottom, args.top)
    model = DistributedDataParallel(dense_arch)
    sparse = SparseRowWiseAdagrad(tables, lr=args.sparse_lr)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    names = tables.names

    def logits_of(batch: Batch, net: nn.Module) -> torch.Tensor:
        pooled = tables(batch.features)
        return net(batch.dense, torch.stack([pooled[name] for name in names], 1))

    replicated = sum(spec.num_rows * spec.dim * 4 for spec in specs)  # float32 rows, all tables on every rank
    if rank == 0:
        kinds = [tables.plan[name].kind for name in names]
        print(f"DLRM on {world} rank(s): 26 tables ({sum(s.num_rows for s in specs):,} rows x {args.dim}; "
              f"{kinds.count('row')} split by rows, {kinds.count('table')} whole on one rank), {DENSE} dense "
              f"features; batch {args.batch} per rank ({args.batch * world} in all), {args.steps} steps",
              flush=True)
    # every step in memory: this rank's rows and Adagrad state, the MLPs and Adam (batches are seeded by step)
    ckpt = convoy.Checkpointer(nn.ModuleDict({"tables": tables, "dense": model}), optimizer,
                               state={"sparse": sparse}, replicated=False)
    start = ckpt.restore()
    if rank == 0 and start:
        print(f"starting at step {start} (round {ctx.round_id}, {ckpt.restored_from})", flush=True)
    losses: list[tuple[int, float]] = []
    window = torch.zeros(2, dtype=torch.float64)  # loss sum and steps since the last line
    dist.barrier()
    began = time.perf_counter()
    for step in range(start, args.steps):
        batch = data.draw(seeded("train", args.seed, rank, step), args.batch)
        loss = F.binary_cross_entropy_with_logits(logits_of(batch, model), batch.labels)
        sparse.zero_grad()
        optimizer.zero_grad()
        loss.backward()
        if ctx.restart_count == 0 and rank == args.kill_rank and step == args.kill_at_step:
            print(f"killing myself (rank {rank}) with SIGKILL in the middle of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        sparse.step()
        optimizer.step()
        ckpt.step(step)
        window += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
        if step % args.log_every == 0 or step == args.steps - 1:
            dist.all_reduce(window)
            mean = (window[0] / window[1]).item()
            losses.append((step, mean))
            window.zero_()
            if rank == 0:
                print(f"step {step} train loss {mean:.4f}", flush=True)
    wall = time.perf_counter() - began
    ckpt.close()

    held = data.draw(seeded("held-out", args.seed), args.eval_size)
    bounds = [int(b) for b in torch.linspace(0, args.eval_size, world + 1).round().long()]
    mine = take(held, bounds[rank], bounds[rank + 1])
    with torch.no_grad():
        scores = logits_of(mine, dense_arch)
    gathered: list = [None] * world  # every rank holds the whole held-out set; only the scores differ
    dist.all_gather_object(gathered, (scores, tables.memory_bytes(), tables.sent_bytes))
    if rank == 0:
        scores = torch.cat([g[0] for g in gathered])
        memory, sent = [g[1] for g in gathered], gathered[0][2]
        held_auc, teacher_auc = auc(scores, held.labels), auc(held.teacher, held.labels)
        log_loss = F.binary_cross_entropy_with_logits(scores, held.labels).item()
        rate = held.labels.mean().item()
        constant = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)) if 0 < rate < 1 else 0.0
        print(f"held-out AUC {held_auc:.4f} (the teacher's own: {teacher_auc:.4f}), log loss {log_loss:.4f} "
              f"(always the click rate {rate:.3f}: {constant:.4f}) on {args.eval_size} samples", flush=True)
        print("embedding memory per rank: " + ", ".join(f"{m / 1e6:.2f}" for m in memory)
              + f" MB; replicated: {replicated / 1e6:.2f} MB on every rank (largest rank "
              f"{100 * max(memory) / replicated:.1f}%)", flush=True)
        print(f"step time {1000 * wall / max(1, args.steps - start):.1f} ms ({args.steps - start} steps in "
              f"{wall:.1f} s); "
              f"all-to-all sent by rank 0: {sent / 1e6:.2f} MB", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({
                "world": world, "steps": args.steps, "batch": args.batch, "dim": args.dim, "rows": args.rows,
                "sharding": args.sharding, "placement": {name: tables.plan[name].kind for name in names},
                "auc": held_auc, "teacher_auc": teacher_auc, "log_loss": log_loss, "constant_log_loss": constant,
                "click_rate": rate, "train_losses": losses, "memory_bytes": memory, "replicated_bytes": replicated,
                "step_s": wall / max(1, args.steps - start), "wall_s": wall, "sent_bytes_rank0": sent}))
    dist.barrier()
    convoy.exit_without_teardown()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConvoyError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
