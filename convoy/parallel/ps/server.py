"""One parameter server's shard: the dense tensors and table rows ``placement`` gives it, its optimizer, and a
version counted per applied push. All of it is one ``state_dict`` so that a killed server comes back with its
shard (``save_shard``/``restore_shard``; ``convoy.Checkpointer`` can hold the same dict).

A push may carry a ``tag`` naming the data it was computed from (a batch's index in the epoch). A server applies
each tag once: a push whose tag it holds already is counted (``duplicates``) and not applied. A data shard given
back by a lost worker is trained again from where the master last heard of it, which can be behind what the
servers got; the tags make that re-delivery harmless, so each batch lands exactly once on every server, and
``tags`` is the count a run is checked against."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from convoy.errors import CheckpointError, ConfigError, ConvoyError
from convoy.parallel.ps.optimizers import OptimizerSpec, apply_dense, apply_rows, new_state
from convoy.parallel.ps.placement import Placement


class PullWaitTimeout(ConvoyError):
    """A pull waited too long for the asking worker's own pushes (its staleness bound) to be applied."""


class ParameterServer:
    """Holds server ``index``'s shard and applies pushed gradients to it, one push at a time (thread-safe)."""

    def __init__(self, index: int, placement: Placement, optimizer: OptimizerSpec,
                 dense: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]) -> None:
        if not 0 <= index < placement.num_servers:
            raise ConfigError(f"parameter server index {index} is outside 0..{placement.num_servers - 1}")
        self.index, self.placement, self.optimizer = index, placement, optimizer.validate()
        expected_dense = placement.dense_on(index)
        if sorted(dense) != expected_dense:
            raise ConfigError(f"parameter server {index} must hold dense tensors {expected_dense} (got "
                              f"{sorted(dense)}); build its shard with shard_of()")
        if sorted(rows) != sorted(placement.tables):
            raise ConfigError(f"parameter server {index} must hold rows of tables {sorted(placement.tables)} "
                              f"(got {sorted(rows)}); build its shard with shard_of()")
        self.dense = {name: tensor.detach().clone() for name, tensor in dense.items()}
        self.rows = {name: tensor.detach().clone() for name, tensor in rows.items()}
        for name, tensor in self.dense.items():
            self._check_shape(f"dense tensor {name!r}", tuple(tensor.shape), placement.dense[name].shape)
        for name, tensor in self.rows.items():
            spec = placement.tables[name]
            self._check_shape(f"rows of table {name!r}", tuple(tensor.shape),
                              (placement.rows_on(name, index), spec.dim))
        self.dense_state = {name: new_state(self.optimizer, t) for name, t in self.dense.items()}
        self.rows_state = {name: new_state(self.optimizer, t) for name, t in self.rows.items()}
        self.version = 0
        self.applied: dict[str, int] = {}
        """Pushes handled per worker id (a skipped duplicate included): what a worker's staleness bound is checked
        against and what its resends after a restore start from."""
        self.tags: set[int] = set()
        """The tags of the pushes applied."""
        self.duplicates = 0
        """Pushes not applied because their tag was applied already."""
        self.changed = threading.Condition()

    def _check_shape(self, what: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
        if got != want:
            raise ConfigError(f"parameter server {self.index}: {what} has shape {list(got)}, this server holds "
                              f"{list(want)}; check the model against the placement")

    def pull(self, ids: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Copies of this server's dense tensors and of the local rows ``ids`` asks for, per table."""
        with self.changed:
            dense = {name: tensor.clone() for name, tensor in self.dense.items()}
            rows = {name: self.rows[name][self._local_ids(name, local)] for name, local in ids.items()}
        return dense, rows

    def _local_ids(self, table: str, local: torch.Tensor) -> torch.Tensor:
        if table not in self.rows:
            raise ConfigError(f"parameter server {self.index} holds no table {table!r} (tables: "
                              f"{sorted(self.rows)}); declare it in the placement")
        local = local.to(torch.int64)
        held = len(self.rows[table])
        if len(local) and (int(local.min()) < 0 or int(local.max()) >= held):
            bad = local[(local < 0) | (local >= held)][0]
            raise ConfigError(f"parameter server {self.index}: local row {int(bad)} of table {table!r} is not "
                              f"held here (it holds rows 0..{held - 1}); map row ids with Placement.local_rows")
        return local

    def push(self, worker: str, dense_grads: Mapping[str, torch.Tensor],
             row_grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], tag: int | None = None) -> int:
        """Apply one worker's gradients (dense tensors by name; per table, local rows and their gradient rows,
        duplicates allowed) and return the new version; a ``tag`` applied already only counts the push as
        handled. Everything is checked before anything changes."""
        for name, grad in dense_grads.items():
            if name not in self.dense:
                raise ConfigError(f"parameter server {self.index} holds no dense tensor {name!r} (it holds "
                                  f"{sorted(self.dense)}); push each gradient to the server the placement names")
            self._check_shape(f"gradient of {name!r}", tuple(grad.shape), tuple(self.dense[name].shape))
        coalesced = {}
        for name, (local, grads) in row_grads.items():
            local = self._local_ids(name, local)
            dim = self.rows[name].shape[1]
            self._check_shape(f"gradient rows of table {name!r}", tuple(grads.shape), (len(local), dim))
            unique, inverse = torch.unique(local, return_inverse=True)
            summed = torch.zeros(len(unique), dim, dtype=grads.dtype).index_add_(0, inverse, grads)
            coalesced[name] = (unique, summed)
        with self.changed:
            self.applied[worker] = self.applied.get(worker, 0) + 1
            if tag is not None and tag in self.tags:
                self.duplicates += 1
                self.changed.notify_all()
                return self.version
            for name, grad in dense_grads.items():
                apply_dense(self.optimizer, self.dense[name], grad, self.dense_state[name])
            for name, (unique, summed) in coalesced.items():
                apply_rows(self.optimizer, self.rows[name], unique, summed, self.rows_state[name])
            self.version += 1
            if tag is not None:
                self.tags.add(tag)
            self.changed.notify_all()
            return self.version

    def wait_applied(self, worker: str, at_least: int, timeout: float) -> int:
        """Block until ``worker``'s pushes applied here reach ``at_least``; return the count. A server that
        waits past ``timeout`` raises rather than hang the worker."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.applied.get(worker, 0) >= at_least, timeout):
                have = self.applied.get(worker, 0)
                raise PullWaitTimeout(f"parameter server {self.index}: worker {worker!r} has {have} pushes applied, "
                                      f"waited {timeout:.0f}s for {at_least}; is its push thread alive?")
            return self.applied.get(worker, 0)

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """Everything needed to come back: values, optimizer state, version and per-worker counts (copies;
        ``copy=False``: the live tensors, for a caller that holds ``changed`` while it copies them out)."""
        keep = (lambda t: t.clone()) if copy else (lambda t: t)
        with self.changed:
            return {"index": self.index, "version": self.version, "applied": dict(self.applied),
                    "tags": torch.tensor(sorted(self.tags), dtype=torch.int64), "duplicates": self.duplicates,
                    "optimizer": self.optimizer.to_dict(),
                    "dense": {name: keep(t) for name, t in self.dense.items()},
                    "rows": {name: keep(t) for name, t in self.rows.items()},
                    "dense_state": _copy_state(self.dense_state) if copy else self.dense_state,
                    "rows_state": _copy_state(self.rows_state) if copy else self.rows_state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["index"] != self.index:
            raise CheckpointError(f"parameter server {self.index} was given the state of server {state['index']};"
                                  f" restore each server from its own file")
        if OptimizerSpec.from_dict(state["optimizer"]) != self.optimizer:
            raise CheckpointError(f"parameter server {self.index}: the saved optimizer {state['optimizer']} is "
                                  f"not this server's {self.optimizer.to_dict()}")
        for kind, mine in (("dense", self.dense), ("rows", self.rows)):
            saved = state[kind]
            if sorted(saved) != sorted(mine) or any(saved[n].shape != mine[n].shape for n in mine):
                raise CheckpointError(f"parameter server {self.index}: the saved {kind} shard does not match this "
                                      f"placement; restore with the placement it was saved under")
        with self.changed:
            for name in self.dense:
                self.dense[name].copy_(state["dense"][name])
            for name in self.rows:
                self.rows[name].copy_(state["rows"][name])
            self.dense_state = _copy_state(state["dense_state"])
            self.rows_state = _copy_state(state["rows_state"])
            self.version, self.applied = int(state["version"]), dict(state["applied"])
            self.tags = set(state["tags"].tolist()) if "tags" in state else set()
            self.duplicates = int(state.get("duplicates", 0))
            self.changed.notify_all()


def _copy_state(states: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in s.items()}
            for name, s in states.items()}


def shard_of(placement: Placement, index: int, dense: Mapping[str, torch.Tensor],
             tables: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Server ``index``'s part of a whole model: its dense tensors, and its rows of every full table."""
    mine = {name: dense[name] for name in placement.dense_on(index)}
    rows = {name: full[index::placement.num_servers] for name, full in tables.items()}
    return mine, rows


def save_shard(server: ParameterServer, path: Path) -> None:
    """Write the server's state to ``path`` atomically (a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(saved_form(server), partial)
    partial.replace(path)


def restore_shard(path: Path) -> ParameterServer:
    """A server rebuilt from ``save_shard``'s file: same shard, optimizer state, version and counts."""
    if not path.is_file():
        raise CheckpointError(f"no parameter-server shard at {path}; pass the file save_shard wrote")
    return server_from_saved(torch.load(path, weights_only=True))  # plain data and tensors: runs no pickled code


def saved_form(server: ParameterServer, copy: bool = True) -> dict[str, Any]:
    """What a save or a snapshot holds: the placement (as plain data) and the server's ``state_dict``."""
    return {"placement": server.placement.to_dict(), "state": server.state_dict(copy)}


def server_from_saved(saved: Mapping[str, Any]) -> ParameterServer:
    """A server rebuilt from ``saved_form``'s dict: same shard, optimizer state, version and counts."""
    state, placement = saved["state"], Placement.from_dict(saved["placement"])
    server = ParameterServer(state["index"], placement, OptimizerSpec.from_dict(state["optimizer"]),
                             state["dense"], state["rows"])
    server.load_state_dict(state)
    return server
