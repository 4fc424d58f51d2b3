"""Save sharded embedding tables one file per rank; load them into any placement (resharding).

``save_sharded`` writes each rank's rows and per-row optimizer state, then a manifest;
``load_sharded`` reads, from the files of whatever world size saved them (memory-mapped, so
only the rows it needs), the rows the current placement gives this rank. The files must be
on a filesystem every rank sees (the run dir).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from convoy.errors import CheckpointError
from convoy.parallel.embedding.bags import ShardedEmbeddingBagCollection
from convoy.parallel.embedding.sparse_optim import SparseSGD


def _shard_file(directory: Path, rank: int, world: int) -> Path:
    return directory / f"embedding-rank{rank}-of-{world}.pt"


def save_sharded(tables: ShardedEmbeddingBagCollection, directory: str | Path,
                 optimizer: SparseSGD | None = None) -> None:
    """Every rank writes its rows (and per-row optimizer state); rank 0 writes the manifest last."""
    directory = Path(directory)
    if tables.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=tables.group)
    shard = {name: {"span": tuple(tables.span(name)), "weight": tables.weights[name],
                    "row_state": optimizer.row_state(name) if optimizer is not None else None}
             for name in tables.names}
    path = _shard_file(directory, tables.rank, tables.world)
    torch.save(shard, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    dist.barrier(group=tables.group)
    if tables.rank == 0:
        settings = {k: v for k, v in optimizer.state_dict().items() if k != "acc"} if optimizer is not None else None
        manifest = {"world": tables.world, "tables": {name: [tables.specs[name].num_rows, tables.dim]
                                                      for name in tables.names}, "optimizer": settings}
        (directory / "embedding-manifest.json").write_text(json.dumps(manifest))
    dist.barrier(group=tables.group)


def load_sharded(tables: ShardedEmbeddingBagCollection, directory: str | Path,
                 optimizer: SparseSGD | None = None) -> None:
    """Load the rows this rank owns now from shards saved at any world size (resharding)."""
    directory = Path(directory)
    manifest_path = directory / "embedding-manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"no embedding checkpoint in {directory} (embedding-manifest.json missing); "
                              "save one with save_sharded first")
    manifest = json.loads(manifest_path.read_text())
    for name in tables.names:
        saved = manifest["tables"].get(name)
        if saved != [tables.specs[name].num_rows, tables.dim]:
            raise CheckpointError(f"table {name!r} is {tables.specs[name].num_rows} x {tables.dim} here but "
                                  f"{saved} in {directory}; load into the same tables")
    mine = {name: tables.span(name).rows() for name in tables.names}  # the table rows this rank holds now
    states = {name: optimizer.row_state(name) if optimizer is not None else None for name in tables.names}
    for rank in range(manifest["world"]):
        path = _shard_file(directory, rank, manifest["world"])
        if not path.is_file():
            raise CheckpointError(f"{path} is missing; the checkpoint in {directory} is incomplete")
        shard = torch.load(path, mmap=True, weights_only=True)
        for name, wanted in mine.items():
            part = shard[name]
            # a file of an older convoy: contiguous rows from "start"
            first, stride = part["span"][:2] if "span" in part else (part["start"], 1)
            offset = wanted - first
            here = (offset >= 0) & (offset % stride == 0) & (offset // stride < len(part["weight"]))
            if not bool(here.any()):
                continue
            theirs = offset[here] // stride
            tables.weights[name][here] = part["weight"][theirs]
            if states[name] is not None and part["row_state"] is not None:
                states[name][here] = part["row_state"][theirs]
    if optimizer is not None and manifest["optimizer"] is not None:
        optimizer.load_state_dict({k: v for k, v in manifest["optimizer"].items() if k != "acc"})
    dist.barrier(group=tables.group)
