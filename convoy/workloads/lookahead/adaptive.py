"""How many draft tokens to verify per pass: the size that maximises expected tokens per second, from measurements.

Pure Python. For each candidate size ``n`` (0 = plain decoding) it keeps a moving average of the pass time ``c(n)``
and of the tokens a draft of size ``n`` *would have* got accepted, ``a(j, n)``, separately for each length ``j`` of
the context match the draft came from (a 4-token match predicts a copied span far better than a 1-token one); it
picks ``argmax (1 + a(j, n)) / c(n)``. ``a`` is learnt in hindsight for every size at once, also while drafting is
off: each step's best draft is kept and, once the true tokens that followed are known, scored at every size. So
drafting switches on by itself when the text starts to repeat what the tries hold, and stays off (costing only a
trie lookup) when it does not. A match length not yet scored in this request is assumed to get ``2 j`` tokens
accepted (optimism: one pass finds out), so the first copied span is drafted at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from convoy.workloads.lookahead.draft import DraftTree

SIZES = (0, 2, 4, 8, 16, 32, 64)
# The extra cost of one draft token relative to a plain pass, per device type, until a size has been timed. A CPU
# pays a large share of a pass per token; a GPU runs a pass of up to ~64 tokens in about the time of one.
PRIOR_COST_SLOPES = {"cpu": 1 / 16, "cuda": 1 / 512}


def prior_cost_slope(device_type: str) -> float:
    """The ``DraftSizer.cost_slope`` prior for a model on ``device_type`` (``torch.device.type``); a type not
    listed gets the CPU's, the cautious guess (one timed pass corrects either)."""
    return PRIOR_COST_SLOPES.get(device_type, PRIOR_COST_SLOPES["cpu"])


@dataclass
class _Pending:
    """A draft proposed for ``position`` of sequence ``row``, waiting for the tokens that really came."""

    row: int
    position: int
    tree: DraftTree
    depth: int
    waited: int = 0  # observations so far


@dataclass
class DraftSizer:
    """Chooses the draft size per pass. ``cost_slope`` is the prior extra cost of one draft token relative to a
    plain pass (the default is the CPU's; see :func:`prior_cost_slope`), used until a size has been timed;
    ``settle_after``: see :meth:`observe`. One sizer serves one batch size (the cost of a pass depends on it);
    the rows of a batch share the acceptance estimates."""

    max_size: int = 32
    smoothing: float = 0.2
    cost_slope: float = 1 / 16
    settle_after: int = 4
    sizes: tuple[int, ...] = field(init=False)
    cost: dict[int, float] = field(init=False, default_factory=dict)
    gain: dict[tuple[int, int], float] = field(init=False)  # (match length, size) -> accepted tokens
    pending: list[_Pending] = field(init=False)

    def __post_init__(self) -> None:
        if self.max_size < 0:
            raise ValueError(f"max_size must be >= 0, got {self.max_size}")
        self.sizes = tuple(size for size in SIZES if size < self.max_size) + (self.max_size,)
        self.sizes = tuple(sorted(set(self.sizes)))
        self.reset()

    def reset(self) -> None:
        """Forget what was learnt about acceptance (a new request), keep the measured costs."""
        self.gain = {}
        self.pending = []

    def bucket(self, size: int) -> int:
        """The smallest candidate size that holds ``size`` draft tokens."""
        return next((s for s in self.sizes if s >= size), self.sizes[-1])

    def choose(self, match_lengths: Sequence[int]) -> int:
        """The draft size for the next pass of rows whose drafts matched ``match_lengths`` context tokens
        (0: decode without drafting)."""
        if 0 not in self.cost:
            return 0  # time a plain pass first: every other cost is relative to it
        base = self.cost[0]
        best, best_rate, floor = 0, len(match_lengths) / base, base
        for size in self.sizes[1:]:  # an untimed size costs the prior, and at least what any smaller size cost
            cost = self.cost.get(size, max(floor, base * (1.0 + self.cost_slope * size)))
            floor = max(floor, cost)
            rate = sum(1.0 + self.gain.get((length, size), min(size, 2.0 * length))
                       for length in match_lengths if length) / cost
            rate += sum(1 for length in match_lengths if not length) / cost
            if rate > best_rate:
                best, best_rate = size, rate
        return best

    def record_time(self, size: int, seconds: float) -> None:
        """One pass with ``size`` draft tokens took ``seconds`` (whole step: drafting, forward, bookkeeping)."""
        size = self.bucket(size)
        old = self.cost.get(size)
        self.cost[size] = seconds if old is None else old + self.smoothing * (seconds - old)

    def propose(self, row: int, position: int, tree: DraftTree) -> None:
        """Remember the best draft for ``tokens[position:]`` of ``row`` to score it once the truth is known."""
        if len(tree):
            self.pending.append(_Pending(row, position, tree, max(tree.depths())))

    def observe(self, row: int, tokens: Sequence[int], finished: bool = False) -> None:
        """Score the pending drafts of ``row`` that ``tokens`` now settles: the truth covers the draft's depth, or
        the draft already left it, or the row ``finished``, or it waited ``settle_after`` steps with every token so
        far drafted right. The last gives a lower bound, only while tokens come one per step (drafting off):
        waiting for the whole depth then would keep drafting off through the first ``branch_length`` tokens of
        every copied span; while drafting, steps bring many tokens and drafts settle exactly."""
        still = []
        for item in self.pending:
            if item.row != row:
                still.append(item)
                continue
            truth = tokens[item.position:item.position + item.depth]
            item.waited += 1
            if (len(truth) < item.depth and item.waited < self.settle_after and not finished
                    and len(item.tree.accepted(truth)) == len(truth)):
                still.append(item)  # every known token was drafted so far: wait for more
                continue
            for size in self.sizes[1:]:
                key = (item.tree.match_length, size)
                accepted = len(item.tree.truncate(size).accepted(truth))
                old = self.gain.get(key)
                self.gain[key] = accepted if old is None else old + self.smoothing * (accepted - old)
        self.pending = still
