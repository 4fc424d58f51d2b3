"""A DLRM-style click model trained asynchronously on parameter servers: one script for every role.

    convoy run --ps 2 --workers 2 examples/train_ps.py
    convoy run --ps 2 --workers auto examples/train_ps.py    # as many workers as fit, sized from the chief

Data and model are ``train_dlrm.py``'s (``dlrm_model.py``: synthetic Criteo-shaped samples, power-law ids, a
hidden teacher; bottom MLP, pairwise interaction, top MLP); the worker's side is in ``ps_parts.py``. Here every
parameter lives on the parameter servers (``convoy.parallel.ps``): the 26 tables sharded by row id, the MLP
tensors spread by size, all updated by Adagrad on the servers. A worker pulls the MLPs and only its batch's rows,
computes the gradients, and pushes them without waiting for them to be applied; ``--staleness S`` lets it run at
most S pushes ahead of what it has seen applied. Worker 0 is the chief: it gives the servers their initial shards,
and when every worker's pushes are in, it scores a held-out set and prints the AUC beside the teacher's. The
servers are stopped by convoy once every worker has finished. The chief has the servers snapshot their shards
every ``--snapshot-every`` steps; a killed server comes back with its shard and the workers resend what it had not
kept (``convoy/parallel/ps/snapshots.py``), so every push is applied exactly once.

Roles come from ``convoy.role()``: ``ps`` serves on ``CONVOY_ROLE_PORT``; ``worker`` finds the servers in
``CONVOY_ROLE_ADDRESSES``. The workers' data comes from the master's shards (``convoy.shards``): the epoch is
``--batches`` (default 2 x ``--steps``) batches, batch ``i`` drawn from the seed a fixed split would give rank
``i // steps`` at step ``i % steps``, handed out as they ask; a worker reports a batch trained once every server
has applied its push, so a worker that fails gives back the batches after the last it reported. The servers may
hold some of those already: each push carries its batch's index as a tag, and a server applies a tag once, so
every batch lands once on every server; the chief prints that count (``exactly once: ...``) at the end. A push is
lost for good when a server and the worker that pushed to it go down together (their node lost): the server comes
back from a snapshot older than the push, and nobody is left to resend it; once the epoch is done, the chief
trains such batches again (``repair``). The chief's
first iteration is the measuring one (``convoy.measure_iteration``): under ``--workers auto`` the master sizes
and starts the other workers from it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dlrm_model import CRITEO_ROWS, MULTI_HOT, DenseArch, Synthetic, auc, seeded  # noqa: E402
from ps_parts import BatchShards, connect, exactly_once, logits_of, pull_when_set_up, push_gradients  # noqa: E402

import convoy  # noqa: E402
import convoy.worker.shards  # noqa: E402
from convoy.errors import ConfigError  # noqa: E402
from convoy.parallel.embedding.bags import TableSpec as BagSpec  # noqa: E402
from convoy.parallel.ps.client import PSClient  # noqa: E402
from convoy.parallel.ps.optimizers import OptimizerSpec  # noqa: E402
from convoy.parallel.ps.placement import DenseSpec, TableSpec, place  # noqa: E402
from convoy.parallel.ps.service import from_role_env  # noqa: E402


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="the epoch's default size: 2 x steps batches")
    parser.add_argument("--shard-batches", type=int, default=10, help="batches per data shard")
    parser.add_argument("--batches", type=int, default=0, help="batches in the epoch (default: 2 x --steps, what two "
                        "workers of --steps each would train); the workers, however many, share them")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rows", type=int, default=20000, help="cap on each table's rows")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05, help="the servers' Adagrad learning rate")
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--held-out", type=int, default=8192)
    parser.add_argument("--slow-worker", type=float, default=0.0, help="seconds worker 1 sleeps per step")
    parser.add_argument("--snapshot-every", type=int, default=20, help="steps between the chief's PS snapshots")
    args = parser.parse_args()
    if min(args.steps, args.batch, args.rows, args.dim, args.shard_batches) < 1 or min(args.staleness,
                                                                                      args.batches) < 0:
        raise ConfigError("--steps, --batch, --rows, --dim and --shard-batches must be >= 1, --staleness and "
                          "--batches >= 0")
    return args


def model_specs(args: argparse.Namespace) -> tuple[DenseArch, list[BagSpec]]:
    torch.manual_seed(args.seed)
    bags = [BagSpec(f"C{i + 1}", min(size, args.rows), args.dim, "mean" if f"C{i + 1}" in MULTI_HOT else "sum")
            for i, size in enumerate(CRITEO_ROWS)]
    return DenseArch(args.dim, len(bags), [64, 32], [64, 32]), bags


def serve() -> None:
    server = from_role_env()
    if server.restored is not None:
        shard = server.restored.server
        print(f"parameter server {convoy.role().rank} restored from its {server.restored.source} at version "
              f"{shard.version} (pushes held {dict(sorted(shard.applied.items()))})", flush=True)
    print(f"parameter server {convoy.role().rank} serving on port {os.environ['CONVOY_ROLE_PORT']}", flush=True)
    server.wait()


def train(args: argparse.Namespace, info: convoy.RoleInfo) -> None:
    arch, bags = model_specs(args)
    dense = {name: p.detach().clone() for name, p in arch.named_parameters()}
    placement = place([DenseSpec(n, tuple(t.shape)) for n, t in dense.items()],
                      [TableSpec(s.name, s.num_rows, s.dim) for s in bags], len(info.peers("ps")))
    client = connect(placement, info.rank, args.staleness)
    if info.rank == 0 and not all(client.ready()):  # a chief started again finds the servers trained on
        init = seeded("tables", args.seed)
        client.setup(OptimizerSpec("adagrad", args.lr),
                     dense, {s.name: torch.randn(s.num_rows, s.dim, generator=init) * 0.01 for s in bags})
    data = Synthetic(bags, args.seed, args.zipf)
    batches = BatchShards(client, args.batches or 2 * args.steps, args.shard_batches)  # not by world size:
    # under --workers auto the chief starts alone, and every worker must declare the same epoch
    started, losses = time.perf_counter(), []
    for step, index in enumerate(batches):
        batch = draw(args, data, index)
        measuring = None
        if step == 0 and info.rank == 0:  # --workers auto sizes the other workers from this iteration
            loaded = [batch.dense, batch.labels, *(t for f in batch.features.values() for t in (f.ids, f.offsets))]
            sample_bytes = max(1, sum(t.numel() * t.element_size() for t in loaded) // args.batch)
            measuring = convoy.measure_iteration(batch_size=args.batch, sample_bytes=sample_bytes, model=arch).begin()
        ids = {s.name: batch.features[s.name].ids for s in bags}
        pulled = pull_when_set_up(client, ids)
        if not batches.seen(pulled):
            continue  # the shard went back to the queue (this worker was taken for lost): stop training it
        loss = push_gradients(client, arch, bags, batch, pulled, index)
        losses.append(loss)
        if measuring is not None:
            measuring.end()
        if args.slow_worker and info.rank == 1:
            time.sleep(args.slow_worker)
        if info.rank == 0 and args.snapshot_every and step % args.snapshot_every == args.snapshot_every - 1:
            client.snapshot()
        if step % 50 == 49:
            print(f"worker {info.rank} step {step + 1}: loss {sum(losses[-50:]) / len(losses[-50:]):.4f}", flush=True)
    client.flush()
    rate = len(losses) * args.batch / (time.perf_counter() - started)
    print(f"worker {info.rank}: {len(losses)} steps, {rate:.0f} samples/s", flush=True)
    client.snapshot(persist=info.rank == 0)  # a server killed after this worker left keeps all of its pushes
    print(f"worker {info.rank}: pushes held per server {client.applied()}, resent {client.resent}, lost "
          f"{client.lost}, servers moved {client.moves}", flush=True)
    if info.rank == 0:
        evaluate(args, client, arch, bags, data, batches.total)
    client.close()


def draw(args: argparse.Namespace, data: Synthetic, index: int):  # noqa: ANN201 (train_dlrm's batch)
    """Batch ``index`` of the epoch: the seed a fixed split would give rank ``index // steps`` at its step."""
    return data.draw(seeded("train", args.seed, *divmod(index, args.steps)), args.batch)


def repair(args: argparse.Namespace, client: PSClient, arch: DenseArch, bags: list[BagSpec], data: Synthetic,
           batches: int) -> int:
    """Once the epoch is done, train again each batch a server lacks and push it tagged: the servers that hold it
    skip it, the others apply it. A server lacks a batch of a finished shard when it came back from a snapshot
    older than a worker's push of that batch and the worker died too (the node that ran both was lost): nobody
    is left to resend the push. Returns how many batches were trained again."""
    lacking = sorted({tag for tally in client.tally() for tag in tally.exactly_once(batches)[0]})
    for index in lacking:
        batch = draw(args, data, index)
        push_gradients(client, arch, bags, batch, client.pull({s.name: batch.features[s.name].ids for s in bags}),
                       index)
    client.flush()
    if lacking:
        print(f"trained {len(lacking)} batches again that a server had lost with a worker: {lacking[:10]}",
              flush=True)
    return len(lacking)


def evaluate(args: argparse.Namespace, client: PSClient, arch: DenseArch, bags: list[BagSpec], data: Synthetic,
             batches: int) -> None:
    """Once every batch of the epoch is applied on every server, score the held-out set."""
    repair(args, client, arch, bags, data, batches)
    held = data.draw(seeded("held-out", args.seed), args.held_out)
    ids = {s.name: held.features[s.name].ids for s in bags}
    deadline = time.monotonic() + 600
    while min((pulled := client.pull(ids)).versions) < batches and time.monotonic() < deadline:
        time.sleep(0.2)
    with torch.no_grad():
        scores = logits_of(arch, bags, pulled, held, pulled.dense, pulled.rows)
    print(f"held-out AUC {auc(scores, held.labels):.4f} (teacher {auc(held.teacher, held.labels):.4f}) after "
          f"{min(pulled.versions)} pushes per server", flush=True)
    print(exactly_once(client.tally(), batches), flush=True)


def main() -> int:
    args = parse()
    info = convoy.role()
    if info.name == "ps":
        serve()
    elif info.name in ("worker", "default"):
        train(args, info)
    else:
        raise ConfigError(f"role {info.name!r}: this script runs the roles ps and worker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
