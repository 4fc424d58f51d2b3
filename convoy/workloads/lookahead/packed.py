"""Linear layers run on weights packed once for oneDNN, while a ``LookaheadGenerator`` decodes.

A verification pass feeds a handful of rows (the root and a draft of 2-64 tokens) through every
linear layer. On CPU that is where stock float32 matmul is weakest: MKL's GEMM pays per row from
the second row on. oneDNN with the weight reordered once into its blocked layout (what
TorchInductor's CPU freezing does) keeps small-row products close to the one-row cost. Measured
on this project's machine, one thread, a 1536x576 weight (microseconds, stock vs packed): 1 row
70 vs 64, 2 rows 135 vs 67, 8 rows 241 vs 149, 17 rows 441 vs 294. Not every shape gains at one to three rows
(SmolLM2-135M, one thread, stock vs packed: 576x576 1 row 36 vs 67, 1536x576 139 vs 167, the 49152x576 head 5788
vs 4858): each weight shape is timed once, both ways, at a few small row counts when it is first packed, and a
pass of up to that shape's crossover (``stock_rows``) runs the stock kernel on the same weight. The numbers are
the same either way up to float32 rounding.

The packed copies cost as much memory as the weights they copy. They are made on first use and
made again when a weight changes, so training or a weight sync between ``generate`` calls never
decodes with stale weights: a new parameter object, new storage (``param.data = ...``), an
in-place write through autograd (``Tensor._version``), or, for writes that bypass the version
counter (``param.data.copy_(...)``), a change in an evenly spread sample of its elements. The model's own
modules are patched only inside the ``with`` block and restored after it, errors included.
"""

from __future__ import annotations

import time
import weakref
from types import MethodType, TracebackType
from typing import Any

import torch

from convoy.workloads.lookahead.errors import DecodingError


CROSSOVER_ROWS = (1, 2, 3, 4, 6, 8)
"""Row counts at which a weight shape's stock and packed kernels are timed against each other."""
CROSSOVER_REPS = 3


def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (CPU builds with mkldnn do)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and ops is not None
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


def packable(module: torch.nn.Module) -> bool:
    """A float32 CPU ``nn.Linear`` (other dtypes keep their own kernels: bf16 numerics would differ)."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor)
            and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2)


def use_packing(requested: bool | None, device: torch.device) -> bool:
    """Whether a generator of a model on ``device`` decodes on packed weights: ``requested`` (None: wherever this
    torch build can, on CPU). Packing is oneDNN's, for CPU float32 weights; asking for it elsewhere is an error."""
    if device.type != "cpu":
        if requested:
            raise DecodingError(f"pack_weights=True, but the model is on {device}: packing is for CPU float32 "
                                "weights; leave pack_weights unset or False for a model on another device")
        return False
    if requested and not packing_available():
        raise DecodingError("pack_weights=True needs a torch build with oneDNN (torch.backends.mkldnn); "
                            "leave pack_weights unset to use packed weights only where they are available")
    return packing_available() if requested is None else bool(requested)


class PackedLinears:
    """``with PackedLinears(model):`` every packable linear layer of ``model`` runs on a packed copy of its weight.

    ``PackedLinears.of(model)`` is the one shared by every generator of that model (one set of copies)."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> PackedLinears:
        shared = _SHARED.get(model)
        if shared is None:
            shared = _SHARED[model] = cls(model)
        return shared

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = [module for module in model.modules() if packable(module)]
        self._packed: dict[int, tuple[torch.Tensor, int, int, torch.Tensor, torch.Tensor]] = {}
        self.stock_rows: dict[tuple[int, int], int] = {}  # weight shape -> most rows the stock kernel runs
        self._depth = 0  # nested blocks (a generator inside another's) patch once, restore at the outermost exit

    def __enter__(self) -> PackedLinears:
        self._depth += 1
        if self._depth > 1:
            return self
        try:
            for module in self.modules:
                packed = self._weight(module)
                module.forward = MethodType(_packed_forward(packed, self._crossover(module, packed)), module)
        except BaseException:
            self._depth = 0
            self._restore()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._restore()

    def _weight(self, module: torch.nn.Linear) -> torch.Tensor:
        weight = module.weight
        sample = _sample(weight)
        known = self._packed.get(id(module))
        if (known is not None and known[0] is weight and known[1] == weight._version
                and known[2] == weight.data_ptr() and torch.equal(known[3], sample)):
            return known[4]
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self._packed[id(module)] = (weight, weight._version, weight.data_ptr(), sample, packed)
        return packed

    def _crossover(self, module: torch.nn.Linear, packed: torch.Tensor) -> int:
        """The most rows up to which the stock kernel beats the packed one on this module's weight shape (timed
        on the first weight of that shape, then kept: 0 where packed wins from one row)."""
        shape = tuple(module.weight.shape)
        if shape not in self.stock_rows:
            with torch.no_grad():
                self.stock_rows[shape] = stock_wins_up_to(module.weight.detach(), module.bias, packed)
        return self.stock_rows[shape]

    def _restore(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)


def _sample(weight: torch.Tensor, count: int = 1024) -> torch.Tensor:
    """About ``count`` elements spread evenly over the weight (a copy): any real weight update moves them."""
    flat = weight.detach().reshape(-1)
    return flat[:: max(flat.numel() // count, 1)].clone()


_SHARED: weakref.WeakKeyDictionary[torch.nn.Module, PackedLinears] = weakref.WeakKeyDictionary()


def stock_wins_up_to(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> int:
    """The largest of ``CROSSOVER_ROWS`` up to which the stock kernel was faster on every row count tried (the
    best of ``CROSSOVER_REPS`` calls each, after one to warm up); 0 where packed is faster from one row."""
    def best(run: Any, x: torch.Tensor) -> float:
        run(x)
        times = []
        for _ in range(CROSSOVER_REPS):
            began = time.perf_counter()
            run(x)
            times.append(time.perf_counter() - began)
        return min(times)

    def stock(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)

    def oned(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    wins = 0
    for rows in CROSSOVER_ROWS:
        x = torch.randn(rows, weight.shape[1])
        if best(stock, x) >= best(oned, x):
            break
        wins = rows
    return wins


def _packed_forward(packed: torch.Tensor, stock_rows: int) -> Any:
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype != torch.float32 or x.device.type != "cpu"
                or x.numel() <= stock_rows * x.shape[-1]):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    return forward
