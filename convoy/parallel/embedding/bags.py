"""Row-sharded embedding bags beside allreduced dense layers, in plain PyTorch (CPU tensors, gloo).

Each table's rows are split over the ranks (row-wise: interleaved, row ``i`` on rank ``i % world``;
table-wise: the whole table on one rank, for small tables; ``placement.py``). Every rank feeds its own
batch. A forward sends each id to the rank that owns its row (one all-to-all of counts, one of ids),
the owner sums the rows of each bag it holds a part of, and the partial sums come back (one
all-to-all) to be added up. The backward sends each bag's output gradient to the owners that
contributed to it; each owner keeps gradients only for the rows that appeared, and a sparse optimizer
(``SparseSGD``, ``SparseRowWiseAdagrad`` in ``sparse_optim.py``) updates only those. Dense layers stay
under DDP.

Row gradients are averaged over ranks like DDP's dense ones (``grad_scale = 1 / world``), so a
model of sharded tables and a DDP dense part trains like one process on the ranks' batches put
together, with the loss averaged over the whole batch. Per-sample weights are constants (they
get no gradient). An empty bag pools to zeros, as ``nn.EmbeddingBag`` does.

``placement.py`` (where rows live, their initial values) is pure; ``store.py``'s ``save_sharded`` /
``load_sharded`` write one file per rank and read back whatever the current placement needs, from any
world size that saved them. A rank's rows are buffers of the module (``state_dict``) and the Adagrad
accumulators are in the optimizer's ``state_dict``, so ``convoy.Checkpointer(tables, state=
{"sparse": optimizer})`` snapshots them in memory and resumes them at the same world size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from convoy.errors import CheckpointError, ConfigError
from convoy.parallel.embedding.placement import Span, TableSpec, init_rows, plan_tables


LAYOUT = 2
"""The rows' layout a ``state_dict`` records (2: row-wise tables interleaved; before it, contiguous ranges)."""


def _spans(state: Any) -> str:
    """A recorded layout in words (``get_extra_state``)."""
    if not isinstance(state, torch.Tensor) or state.dim() != 1 or len(state) % 3 != 1:
        return f"unreadable: {type(state).__name__}"
    values = state.tolist()
    spans = [f"first {values[i]} stride {values[i + 1]} x {values[i + 2]}" for i in range(1, len(values), 3)]
    return f"layout {values[0]}, " + "; ".join(spans)


class Bags(NamedTuple):
    """One feature's batch: ``ids`` of all bags in a row, ``offsets[i]`` where bag ``i`` starts
    (``nn.EmbeddingBag``'s layout), optional ``weights`` per id."""

    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None = None


def check_bags(spec: TableSpec, bags: Bags) -> None:
    ids, offsets, weights = bags
    if ids.dtype != torch.int64 or offsets.dtype != torch.int64 or ids.dim() != 1 or offsets.dim() != 1:
        raise ConfigError(f"feature {spec.name!r}: ids and offsets must be 1-D int64 tensors "
                          f"(got {ids.dtype} {tuple(ids.shape)} and {offsets.dtype} {tuple(offsets.shape)})")
    if len(ids):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= spec.num_rows:
            bad = low if low < 0 else high
            where = int(((ids < 0) | (ids >= spec.num_rows)).nonzero()[0])
            raise ConfigError(f"feature {spec.name!r}: id {bad} (position {where}) is outside the table's "
                              f"{spec.num_rows} rows; ids must be in 0..{spec.num_rows - 1}")
    if len(offsets) and (int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any())
                         or int(offsets[-1]) > len(ids)):
        raise ConfigError(f"feature {spec.name!r}: offsets must start at 0, never decrease, and stay <= the "
                          f"number of ids ({len(ids)}); got {offsets[:8].tolist()}...")
    if weights is not None and (weights.shape != ids.shape or not weights.is_floating_point()):
        raise ConfigError(f"feature {spec.name!r}: per-sample weights must be floats shaped like ids "
                          f"({tuple(ids.shape)}), got {weights.dtype} {tuple(weights.shape)}")


class _Route:
    """Where this step's entries went and came from; kept between forward and backward.

    A sender's entries for one owner are in (table, bag) key order (each table's bags in order, table after table),
    so what an owner receives is runs of equal keys, source after source: a run is one bag's part on this rank."""

    def __init__(self) -> None:
        self.sent_keys: list[torch.Tensor] = []  # per destination: the distinct (table, bag) keys sent there
        self.recv_run: torch.Tensor = torch.empty(0, dtype=torch.int64)  # received entry -> its run
        self.recv_unique: list[int] = []  # runs per source
        self.recv_table: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.recv_row: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.recv_weight: torch.Tensor = torch.empty(0)


def _runs(keys: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """For keys sorted within each of the consecutive parts of ``counts`` entries: (each entry's run index, each
    run's first entry, runs per part), a run being equal keys within one part."""
    starts = torch.ones(len(keys), dtype=torch.bool)
    if len(keys) > 1:
        torch.ne(keys[1:], keys[:-1], out=starts[1:])
    first = 0
    for count in counts[:-1]:
        first += count
        if first < len(keys):
            starts[first] = True  # a part's first entry starts a run
    per_part = [int(part.sum()) for part in starts.split(counts)]
    return starts.cumsum(0) - 1, starts.nonzero().squeeze(1), per_part


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, module: ShardedEmbeddingBagCollection,
                features: dict[str, Bags]) -> torch.Tensor:
        out, route = module._forward(features)
        ctx.module, ctx.route = module, route
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        ctx.module._backward(ctx.route, grad.contiguous())
        return torch.zeros(()), None, None


class ShardedEmbeddingBagCollection(nn.Module):
    """Tables of one width, sharded over ``group``; ``forward({name: Bags})`` returns
    ``{name: (batch, dim)}`` pooled vectors for this rank's batch (every feature must have the
    same number of bags)."""

    def __init__(self, specs: Sequence[TableSpec], group: dist.ProcessGroup | None = None, seed: int = 0,
                 grad_scale: float | None = None) -> None:
        super().__init__()
        if not specs:
            raise ConfigError("give at least one embedding table")
        dims = {spec.dim for spec in specs}
        if len(dims) != 1:
            raise ConfigError(f"tables of one collection share one dim (got {sorted(dims)}); "
                              "make one collection per width")
        self.specs = {spec.name: spec for spec in specs}
        self.names = [spec.name for spec in specs]
        self.dim = dims.pop()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.plan = plan_tables(specs, self.world)
        self.grad_scale = 1.0 / self.world if grad_scale is None else grad_scale
        bad = [name for name in self.names if "." in name]
        if bad:
            raise ConfigError(f"table names {bad} contain '.'; name tables without dots")
        self.weights: dict[str, torch.Tensor] = {}
        self.rows = nn.Module()  # this rank's rows as buffers: in state_dict, so convoy.Checkpointer keeps them
        for name in self.names:
            first, stride, count = self.span(name)
            self.weights[name] = init_rows(self.specs[name], seed, first, first + stride * count, stride)
            self.rows.register_buffer(name, self.weights[name])
        self._anchor = torch.zeros((), requires_grad=True)  # lets autograd reach the backward
        self.pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in self.names}
        self.sent_bytes = 0

    def span(self, name: str) -> Span:
        """This rank's rows of ``name``: table rows ``first + stride * k``, local row ``k`` (``placement.py``)."""
        return self.plan[name].span(self.rank)

    def memory_bytes(self) -> int:
        """Bytes of the table rows this rank holds."""
        return sum(w.numel() * w.element_size() for w in self.weights.values())

    def get_extra_state(self) -> torch.Tensor:
        """What ``state_dict`` records beside the rows: the layout and this rank's span of each table, so that
        rows saved under another placement are refused on load, not restored into the wrong places."""
        return torch.tensor([LAYOUT, *(value for name in self.names for value in self.span(name))])

    def set_extra_state(self, state: Any) -> None:
        mine = self.get_extra_state()
        if not isinstance(state, torch.Tensor) or not torch.equal(state.cpu().to(mine.dtype), mine):
            raise CheckpointError(f"these embedding rows were saved under a placement ({_spans(state)}) other than "
                                  f"this rank's ({_spans(mine)}); restore them with "
                                  "store.load_sharded from a save_sharded file, which reads any placement")

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        rows = any(key.startswith(f"{prefix}rows.") for key in state_dict)
        if rows and f"{prefix}_extra_state" not in state_dict:
            raise CheckpointError("these embedding rows were saved without their placement (by convoy before row-wise "
                                  "tables were interleaved, row i on rank i % world): they cannot be placed safely; "
                                  "restore them with store.load_sharded from a save_sharded file")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, features: Mapping[str, Bags]) -> dict[str, torch.Tensor]:
        missing = [name for name in self.names if name not in features]
        extra = sorted(set(features) - set(self.names))
        if missing or extra:
            raise ConfigError(f"features {missing} missing and {extra} unknown; give exactly {self.names}")
        features = {name: Bags(*features[name]) for name in self.names}
        sizes = {name: len(features[name].offsets) for name in self.names}
        if len(set(sizes.values())) != 1:
            raise ConfigError(f"every feature needs the same number of bags (got {sizes})")
        for name in self.names:
            check_bags(self.specs[name], features[name])
        out = _Lookup.apply(self._anchor, self, features)
        batch = sizes[self.names[0]]
        return {name: out[index * batch:(index + 1) * batch] for index, name in enumerate(self.names)}

    def _all_to_all(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=self.group)
        self.sent_bytes += (sum(send) - send[self.rank]) * tensor[0:1].numel() * tensor.element_size() \
            if len(tensor) else 0
        return out

    @torch.no_grad()
    def _forward(self, features: dict[str, Bags]) -> tuple[torch.Tensor, _Route]:
        batch = len(features[self.names[0]].offsets)
        keys, tables, rows, weights, owners = [], [], [], [], []
        for index, name in enumerate(self.names):
            ids, offsets, given = features[name]
            lengths = torch.diff(offsets, append=torch.tensor([len(ids)]))
            bag = torch.repeat_interleave(torch.arange(batch), lengths)
            weight = given.float() if given is not None else torch.ones(len(ids))
            if self.specs[name].pooling == "mean":
                weight = weight / lengths.clamp(min=1)[bag]
            owner = self.plan[name].owners(ids)
            keys.append(index * batch + bag)
            tables.append(torch.full_like(ids, index))
            rows.append(self.plan[name].local(ids))
            weights.append(weight)
            owners.append(owner)
        owner = torch.cat(owners)
        order = torch.argsort(owner, stable=True)
        key, table, row, weight = (torch.cat(t)[order] for t in (keys, tables, rows, weights))
        send = torch.bincount(owner, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        ints = self._all_to_all(torch.stack([key, table, row], 1), send_counts, recv_counts)
        route = _Route()
        route.recv_weight = self._all_to_all(weight, send_counts, recv_counts)
        route.recv_table, route.recv_row = ints[:, 1], ints[:, 2]
        route.sent_keys = [torch.unique_consecutive(part) for part in key.split(send_counts)]
        route.recv_run, firsts, route.recv_unique = _runs(ints[:, 0], recv_counts)
        back = self._all_to_all(self._partial_sums(route, firsts), route.recv_unique,
                                [len(k) for k in route.sent_keys])
        out = torch.zeros(len(self.names) * batch, self.dim)
        out.index_add_(0, torch.cat(route.sent_keys), back)
        return out, route

    def _partial_sums(self, route: _Route, firsts: torch.Tensor) -> torch.Tensor:
        """Each run's weighted sum of its rows: one bag's part on this rank, in the order the runs came in."""
        if not len(firsts):
            return torch.empty(0, self.dim)
        if len(self.names) == 1:  # one fused gather-and-sum over this rank's rows
            return torch.nn.functional.embedding_bag(route.recv_row, self.weights[self.names[0]], firsts, mode="sum",
                                                     per_sample_weights=route.recv_weight)
        vectors = torch.empty(len(route.recv_row), self.dim)
        for index, name in enumerate(self.names):
            mask = route.recv_table == index
            if bool(mask.any()):
                vectors[mask] = self.weights[name].index_select(0, route.recv_row[mask])
        vectors.mul_(route.recv_weight.unsqueeze(1))
        return torch.zeros(len(firsts), self.dim).index_add_(0, route.recv_run, vectors)

    @torch.no_grad()
    def _backward(self, route: _Route, grad: torch.Tensor) -> None:
        sent = [len(k) for k in route.sent_keys]
        outgoing = grad.index_select(0, torch.cat(route.sent_keys))
        incoming = self._all_to_all(outgoing, sent, route.recv_unique)
        grads = incoming.index_select(0, route.recv_run)  # each entry's bag gradient
        grads.mul_((route.recv_weight * self.grad_scale).unsqueeze(1))
        if len(self.names) == 1:
            if len(grads):
                self.pending[self.names[0]].append((route.recv_row, grads))
            return
        for index, name in enumerate(self.names):
            mask = route.recv_table == index
            if bool(mask.any()):
                self.pending[name].append((route.recv_row[mask], grads[mask]))

    def take_grads(self, name: str, distinct: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's (unique local rows, summed gradient rows) of ``name`` since the last call; with ``distinct``
        False, (local row, gradient) per entry that reached it, a row as often as it was looked up (for an update
        that adds them up anyway, as ``index_add_`` does)."""
        parts = self.pending[name]
        self.pending[name] = []
        if not parts:
            return None
        rows = torch.cat([r for r, _ in parts]) if len(parts) > 1 else parts[0][0]
        grads = torch.cat([g for _, g in parts]) if len(parts) > 1 else parts[0][1]
        if not distinct:
            return rows, grads
        unique, inverse = torch.unique(rows, return_inverse=True)
        return unique, torch.zeros(len(unique), self.dim).index_add_(0, inverse, grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.pending = {name: [] for name in self.names}

    def full_table(self, name: str) -> torch.Tensor:
        """The whole table, gathered on every rank (for tests and small tables)."""
        pieces: list[Any] = [None] * self.world
        dist.all_gather_object(pieces, (self.span(name), self.weights[name]), group=self.group)
        table = torch.empty(self.specs[name].num_rows, self.dim)
        for span, rows in pieces:
            table[Span(*span).rows()] = rows
        return table


class ShardedEmbeddingBag(ShardedEmbeddingBagCollection):
    """One table: ``forward(ids, offsets, per_sample_weights=None)`` returns ``(batch, dim)``, like
    ``nn.EmbeddingBag`` (``include_last_offset=False``), with the rows sharded over ``group``."""

    def __init__(self, num_rows: int, dim: int, pooling: str = "sum", sharding: str = "row",
                 group: dist.ProcessGroup | None = None, seed: int = 0, name: str = "table") -> None:
        super().__init__([TableSpec(name, num_rows, dim, pooling, sharding)], group, seed)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,  # type: ignore[override]
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        name = self.names[0]
        return super().forward({name: Bags(ids, offsets, per_sample_weights)})[name]
