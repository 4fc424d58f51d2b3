"""One process of the async-PS-vs-synchronous benchmark (benchmarks/ps.py): a parameter server, an async PS
worker, or a rank of one of the two synchronous peers, all on examples/train_dlrm.py's model and data.

    python ps_worker.py --mode server --port P
    python ps_worker.py --mode ps|convoy-ddp|torch-ddp --rank R --world W --store-port P --out F ...

The epoch is ``--batches`` fixed batches (batch ``k`` drawn from the stream ``train/seed/k``), the same for
every system. The synchronous ranks split it statically (rank ``r`` trains batches ``r, r + W, ...``, as a
distributed sampler does); the async workers claim shards of ``--shard`` batches from a shared counter as they
go (dynamic shards), so a slow worker takes fewer. Every system starts from the same weights (``init_rows``
for the tables, the seeded MLPs). Rank ``--slow-rank`` sleeps after each step as long as that step took it.
Each process writes its training window (wall-clock start and end) and rank 0 the held-out AUC as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
from dlrm_model import CRITEO_ROWS, MULTI_HOT, DenseArch, Synthetic, auc, seeded, take  # noqa: E402
from ps_parts import logits_of as ps_logits  # noqa: E402
from ps_parts import pull_when_set_up

from convoy.parallel.embedding.bags import ShardedEmbeddingBagCollection, TableSpec, init_rows  # noqa: E402
from convoy.parallel.embedding.sparse_optim import SparseRowWiseAdagrad  # noqa: E402
from convoy.parallel.ps.client import PSClient  # noqa: E402
from convoy.parallel.ps.optimizers import OptimizerSpec  # noqa: E402
from convoy.parallel.ps.placement import DenseSpec, place  # noqa: E402
from convoy.parallel.ps.placement import TableSpec as PSTable
from convoy.parallel.ps.service import ServerProcess  # noqa: E402

MLP_BOTTOM, MLP_TOP = [64], [64, 32]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["server", "ps", "convoy-ddp", "torch-ddp"], required=True)
    parser.add_argument("--port", type=int, default=0, help="server: the port to serve on")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--store-port", type=int, default=0, help="rank 0 hosts a TCPStore here")
    parser.add_argument("--servers", default="", help="ps: comma-separated host:port of the servers")
    parser.add_argument("--batches", type=int, default=400, help="batches in the epoch (all workers together)")
    parser.add_argument("--shard", type=int, default=4, help="ps: batches per claimed shard")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rows", type=int, default=20000, help="cap on each table's rows")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3, help="the MLPs' learning rate (Adam; ps: its optimizer)")
    parser.add_argument("--sparse-lr", type=float, default=0.05, help="the tables' Adagrad learning rate")
    parser.add_argument("--ps-optimizer", default="adagrad", help="ps: the servers' optimizer (every tensor)")
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--slow-rank", type=int, default=1, help="this rank sleeps as long as each step took")
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", type=int, default=16384)
    parser.add_argument("--out", default="")
    parser.add_argument("--check-sparse", action="store_true", help="torch's sparse-tensor invariant checks on")
    return parser.parse_args()


def table_specs(args: argparse.Namespace) -> list[TableSpec]:
    return [TableSpec(f"C{i + 1}", min(size, args.rows), args.dim, "mean" if f"C{i + 1}" in MULTI_HOT else "sum")
            for i, size in enumerate(CRITEO_ROWS)]


def dense_arch(args: argparse.Namespace, specs: list[TableSpec]) -> DenseArch:
    torch.manual_seed(args.seed)
    return DenseArch(args.dim, len(specs), MLP_BOTTOM, MLP_TOP)


def full_rows(spec: TableSpec, seed: int) -> torch.Tensor:
    return init_rows(spec, seed, 0, spec.num_rows)


class Pacer:
    """The slow rank sleeps after each step as long as the step's own work took."""

    def __init__(self, slow: bool) -> None:
        self.slow, self.started, self.work_s, self.steps = slow, 0.0, 0.0, 0

    def begin(self) -> None:
        self.started = time.perf_counter()

    def end(self) -> None:
        took = time.perf_counter() - self.started
        self.work_s += took
        self.steps += 1
        if self.slow:
            time.sleep(took)


def store_of(args: argparse.Namespace) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", args.store_port, args.world, args.rank == 0, timedelta(seconds=300))


def barrier(store: dist.TCPStore, name: str, world: int) -> None:
    store.add(name, 1)
    deadline = time.monotonic() + 300
    while int(store.add(name, 0)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: not every one of {world} processes arrived in 300 s")
        time.sleep(0.002)


def finish(store: dist.TCPStore, rank: int, world: int) -> None:
    """Rank 0 hosts the store, so it leaves last: the others check out and go, rank 0 waits for them."""
    if rank:
        store.add("left", 1)
    else:
        barrier(store, "left", world)


def run_ps(args: argparse.Namespace, store: dist.TCPStore) -> dict:
    specs = table_specs(args)
    arch = dense_arch(args, specs)
    dense = {name: p.detach().clone() for name, p in arch.named_parameters()}
    addresses = args.servers.split(",")
    placement = place([DenseSpec(n, tuple(t.shape)) for n, t in dense.items()],
                      [PSTable(s.name, s.num_rows, s.dim) for s in specs], len(addresses))
    client = PSClient(placement, addresses, f"worker{args.rank}", args.staleness)
    if args.rank == 0:
        client.setup(OptimizerSpec(args.ps_optimizer, args.lr), dense, {s.name: full_rows(s, args.seed) for s in specs})
    data = Synthetic(specs, args.seed, args.zipf)
    pacer = Pacer(args.rank == args.slow_rank)
    barrier(store, "ready", args.world)
    started, trained = time.time(), 0
    while True:
        first = (int(store.add("claimed", 1)) - 1) * args.shard
        if first >= args.batches:
            break
        for k in range(first, min(first + args.shard, args.batches)):
            pacer.begin()
            batch = data.draw(seeded("train", args.seed, k), args.batch)
            pulled = pull_when_set_up(client, {s.name: batch.features[s.name].ids for s in specs})
            params = {n: t.requires_grad_() for n, t in pulled.dense.items()}
            rows = {n: t.requires_grad_() for n, t in pulled.rows.items()}
            loss = F.binary_cross_entropy_with_logits(ps_logits(arch, specs, pulled, batch, params, rows),
                                                      batch.labels)
            loss.backward()
            client.push({n: t.grad for n, t in params.items()},
                        {n: (pulled.ids[n], t.grad) for n, t in rows.items()})
            trained += 1
            pacer.end()
    client.flush()
    result = {"start": started, "end": time.time(), "batches": trained, "work_s": pacer.work_s}
    if args.rank == 0:
        held = data.draw(seeded("held-out", args.seed), args.held_out)
        ids = {s.name: held.features[s.name].ids for s in specs}
        deadline = time.monotonic() + 300
        while min((pulled := client.pull(ids)).versions) < args.batches:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the servers applied {min(pulled.versions)} of {args.batches} pushes in 300 s")
            time.sleep(0.05)
        with torch.no_grad():
            result["auc"] = auc(ps_logits(arch, specs, pulled, held, pulled.dense, pulled.rows), held.labels)
        result["teacher_auc"] = auc(held.teacher, held.labels)
    barrier(store, "scored", args.world)
    if args.rank == 0:
        client.shutdown_servers()
    client.close()
    return result


class TorchDLRM(nn.Module):
    """The same model as plain torch writes it: one ``nn.EmbeddingBag(sparse=True)`` per table."""

    def __init__(self, args: argparse.Namespace, specs: list[TableSpec]) -> None:
        super().__init__()
        self.names = [s.name for s in specs]
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(s.num_rows, s.dim, mode=s.pooling, sparse=True, _weight=full_rows(s, args.seed))
            for s in specs)
        self.arch = dense_arch(args, specs)

    def forward(self, dense: torch.Tensor, features: dict) -> torch.Tensor:
        pooled = [bag(features[name].ids, features[name].offsets) for name, bag in zip(self.names, self.bags)]
        return self.arch(dense, torch.stack(pooled, 1))


def run_sync(args: argparse.Namespace, store: dist.TCPStore) -> dict:
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=args.rank, world_size=args.world)
    specs = table_specs(args)
    data = Synthetic(specs, args.seed, args.zipf)
    if args.mode == "convoy-ddp":
        tables = ShardedEmbeddingBagCollection(specs, seed=args.seed)
        arch = dense_arch(args, specs)
        model = DistributedDataParallel(arch)
        optimizers = [torch.optim.Adam(model.parameters(), lr=args.lr), SparseRowWiseAdagrad(tables, args.sparse_lr)]

        def logits(batch, net):  # noqa: ANN001,ANN202
            pooled = tables(batch.features)
            return net(batch.dense, torch.stack([pooled[name] for name in tables.names], 1))
    else:
        torch_model = TorchDLRM(args, specs)
        model = DistributedDataParallel(torch_model)
        optimizers = [torch.optim.Adam(torch_model.arch.parameters(), lr=args.lr),
                      torch.optim.Adagrad(torch_model.bags.parameters(), lr=args.sparse_lr)]

        def logits(batch, net):  # noqa: ANN001,ANN202
            return net(batch.dense, batch.features)
    pacer = Pacer(args.rank == args.slow_rank)
    dist.barrier()
    started, trained = time.time(), 0
    for k in range(args.rank, args.batches - args.batches % args.world, args.world):
        pacer.begin()
        batch = data.draw(seeded("train", args.seed, k), args.batch)
        loss = F.binary_cross_entropy_with_logits(logits(batch, model), batch.labels)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        trained += 1
        pacer.end()
    dist.barrier()
    result = {"start": started, "end": time.time(), "batches": trained, "work_s": pacer.work_s}
    held = data.draw(seeded("held-out", args.seed), args.held_out)
    with torch.no_grad():
        if args.mode == "convoy-ddp":
            bounds = [int(b) for b in torch.linspace(0, args.held_out, args.world + 1).round().long()]
            mine = logits(take(held, bounds[args.rank], bounds[args.rank + 1]), arch)
            gathered: list = [None] * args.world
            dist.all_gather_object(gathered, mine)
            scores = torch.cat(gathered)
        else:
            scores = logits(held, torch_model)
    if args.rank == 0:
        result["auc"] = auc(scores, held.labels)
        result["teacher_auc"] = auc(held.teacher, held.labels)
    dist.barrier()
    dist.destroy_process_group()
    return result


def main() -> int:
    args = parse()
    torch.set_num_threads(1)
    if args.check_sparse:
        torch.sparse.check_sparse_tensor_invariants.enable()
    if args.mode == "server":
        server = ServerProcess("127.0.0.1", args.port)
        server.wait()
        return 0
    store = store_of(args)
    result = run_ps(args, store) if args.mode == "ps" else run_sync(args, store)
    result |= {"rank": args.rank, "mode": args.mode}
    Path(args.out).write_text(json.dumps(result))
    finish(store, args.rank, args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
