"""One rank of the embedding benchmark: a click model of one large table and a dense MLP.

    python embedding_worker.py --mode sharded|replicated|replicated-sparse|single --rows N
        [--dim 64] [--steps 12] --out F

Each rank draws its own batches (seeded by rank and step): bags of ``--hot`` ids per sample from
a skewed (power-law) distribution. ``sharded``: convoy's row-sharded table with sparse SGD, the
dense MLP under DDP. ``replicated``: ``nn.EmbeddingBag`` and the MLP together under DDP (the
table's dense gradient allreduced), SGD. ``replicated-sparse``: the same with
``nn.EmbeddingBag(sparse=True)``: backward gives the table a sparse gradient (the looked-up rows
only), DDP allreduces it as a sparse tensor (gloo gathers every rank's indices and values) and
``torch.optim.SGD``, which takes sparse gradients, updates only those rows; plain SGD at the same
rate as convoy's ``SparseSGD`` and dense SGD, so all three take the same steps. ``single``: one
process on all ranks' batches put together (``--world`` of them), the reference for the loss.
Every mode starts from the same rows (``init_rows``). Rank 0 writes per-step losses, step times
and memory as JSON. Memory is measured: each rank's anonymous resident memory (``RssAnon``) just
before the model is built (torch and torch._dynamo imported, the process group up) and after every step, while
the step's gradients are still held; the busiest rank's largest growth is what the table, its
gradients, its optimizer and the collectives' buffers took. The table's gradient bytes are the
dense gradient's size, or for ``replicated-sparse`` the largest sparse gradient (indices and
values, after DDP's allreduce) seen in any step.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch
import torch._dynamo  # noqa: F401  (DDP imports it when built: loaded here, its ~70 MB of modules fall in the base)
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import convoy
from convoy.parallel.embedding.bags import Bags, ShardedEmbeddingBagCollection, TableSpec, init_rows
from convoy.parallel.embedding.sparse_optim import SparseSGD

LR = 0.05


def batch(rank: int, step: int, args: argparse.Namespace) -> tuple[Bags, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    skewed = torch.rand(args.batch * args.hot, generator=gen).pow(3)  # most ids near 0: a hot head
    ids = (skewed * args.rows).long().clamp(max=args.rows - 1)
    offsets = torch.arange(0, args.batch * args.hot, args.hot)
    labels = (torch.rand(args.batch, 1, generator=gen) < 0.3).float()
    return Bags(ids, offsets), labels


def mlp(dim: int) -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))


def fill_rows(weight: torch.Tensor, spec: TableSpec) -> None:
    """The same initial rows as the sharded table, written in blocks (no second full copy)."""
    step = 1 << 20
    with torch.no_grad():
        for start in range(0, spec.num_rows, step):
            end = min(spec.num_rows, start + step)
            weight[start:end] = init_rows(spec, 0, start, end)


def sparse_bytes(grad: torch.Tensor | None) -> int:
    """What a sparse gradient holds: its row indices (int64) and its values."""
    if grad is None:
        return 0
    indices, values = grad._indices(), grad._values()
    return indices.numel() * indices.element_size() + values.numel() * values.element_size()


class Replicated(nn.Module):
    def __init__(self, spec: TableSpec, sparse: bool = False) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(spec.num_rows, spec.dim, mode="sum", sparse=sparse,
                                     _weight=torch.empty(spec.num_rows, spec.dim))
        fill_rows(self.table.weight, spec)
        self.head = mlp(spec.dim)

    def forward(self, bags: Bags) -> torch.Tensor:
        return self.head(self.table(bags.ids, bags.offsets))


def anonymous_bytes() -> int:
    """This process's anonymous resident memory now (``RssAnon``: its heap, not the pages of the
    shared libraries that a first forward and backward touch)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["sharded", "replicated", "replicated-sparse", "single"], required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--hot", type=int, default=20)
    parser.add_argument("--world", type=int, default=4, help="single: how many ranks' batches to put together")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = TableSpec("table", args.rows, args.dim, sharding="row")
    loss_fn = nn.BCEWithLogitsLoss()
    if args.mode == "single":
        rank, world = 0, 1
        base_anon = anonymous_bytes()
        model = Replicated(spec)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        dist.barrier()  # gloo's pairs are made, so their buffers count in the base
        base_anon = anonymous_bytes()
    if args.mode == "sharded":
        tables = ShardedEmbeddingBagCollection([spec])
        head = DistributedDataParallel(mlp(args.dim))
        sparse, dense = SparseSGD(tables, lr=LR), torch.optim.SGD(head.parameters(), lr=LR)
        rows_bytes, grad_bytes = tables.memory_bytes(), 0
    elif args.mode == "replicated":
        model = DistributedDataParallel(Replicated(spec), gradient_as_bucket_view=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    elif args.mode == "replicated-sparse":
        model = DistributedDataParallel(Replicated(spec, sparse=True))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if args.mode != "sharded":
        rows_bytes = grad_bytes = args.rows * args.dim * 4  # the rows and their dense gradient
    if args.mode == "replicated-sparse":
        grad_bytes = 0  # the largest sparse gradient, measured below
    losses, times, grown = [], [], 0
    for step in range(args.steps):
        if args.mode == "single":
            parts = [batch(r, step, args) for r in range(args.world)]
            ids = torch.cat([p[0].ids for p in parts])
            bags = Bags(ids, torch.arange(0, len(ids), args.hot))
            labels = torch.cat([p[1] for p in parts])
        else:
            bags, labels = batch(rank, step, args)
        if world > 1:
            dist.barrier()
        began = time.perf_counter()
        if args.mode == "sharded":
            sparse.zero_grad()
            dense.zero_grad()
            loss = loss_fn(head(tables({"table": bags})["table"]), labels)
            loss.backward()
            sparse.step()
            dense.step()
        elif args.mode == "replicated-sparse":
            optimizer.zero_grad()
            loss = loss_fn(model(bags), labels)
            loss.backward()
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=False)
            loss = loss_fn(model(bags), labels)
            loss.backward()
            optimizer.step()
        times.append(time.perf_counter() - began)
        grown = max(grown, anonymous_bytes() - base_anon)  # the gradients are still held here
        if args.mode == "replicated-sparse":
            grad_bytes = max(grad_bytes, sparse_bytes(model.module.table.weight.grad))
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if world > 1:
        peaks: list = [None] * world
        dist.all_gather_object(peaks, (peak_rss, grown))
        peak_rss, grown = max(p[0] for p in peaks), max(p[1] for p in peaks)
    if rank == 0:
        with open(args.out, "w") as out:
            json.dump({"mode": args.mode, "rows": args.rows, "world": world, "losses": losses, "times": times,
                       "rows_bytes": rows_bytes, "grad_bytes": grad_bytes, "peak_rss": peak_rss,
                       "anon_grown": grown}, out)
    if world > 1:
        dist.barrier()
    convoy.exit_without_teardown()


if __name__ == "__main__":
    sys.exit(main())
