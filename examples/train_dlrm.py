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

Data and model are in ``dlrm_model.py``. Model (as DLRM): a bottom MLP maps the dense features to
``--dim``; the interaction is the dot product of every pair of the 27 vectors (26 pooled embeddings and the
bottom output), concatenated with the bottom output; a top MLP gives the logit (binary cross-entropy). The MLPs
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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dlrm_model import CRITEO_ROWS, DENSE, MULTI_HOT, Batch, DenseArch, Synthetic, auc, seeded, take
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import convoy
from convoy.errors import ConfigError, ConvoyError
from convoy.parallel.embedding.bags import ShardedEmbeddingBagCollection, TableSpec
from convoy.parallel.embedding.sparse_optim import SparseRowWiseAdagrad


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
