"""A token trie of spans seen before (the prompt, earlier outputs), queried by the last few tokens for drafts.

Pure Python, no torch. A node is ``[weight, children]`` with ``children: dict[token, node]``; the weight of a node is
how often (decayed) the path from the root to it was inserted, so a child never outweighs its parent.
"""

from __future__ import annotations

from typing import Iterator, Sequence

Node = list  # [weight: float, children: dict[int, Node]]


def _new_node() -> Node:
    return [0.0, {}]


class TokenTrie:
    """Token spans with decayed frequencies, a node cap, and lookup by the longest matching suffix.

    ``window`` is the length of the spans inserted at each position (match length + branch length), so a match of
    ``j`` tokens can draft ``window - j`` tokens. ``decay`` in (0, 1] scales down everything inserted before each
    :meth:`new_epoch` (one epoch per request), so old outputs count less. Past ``max_nodes`` nodes, the lightest
    subtrees are pruned.
    """

    def __init__(self, window: int, max_nodes: int = 1_000_000, decay: float = 1.0) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.window, self.max_nodes, self.decay = window, max_nodes, decay
        self.root: Node = _new_node()
        self.num_nodes = 0
        self._scale = 1.0  # weight of one insertion now; grows by 1/decay per epoch instead of decaying every node

    def new_epoch(self) -> None:
        """Make everything inserted so far count ``decay`` times less than what comes next."""
        if self.decay == 1.0:
            return
        self._scale /= self.decay
        if self._scale > 1e12:  # renormalise before the weights lose precision
            self._rescale(1.0 / self._scale)
            self._scale = 1.0

    def insert(self, span: Sequence[int], weight: float = 1.0, known: int = 0) -> None:
        """Add one path: every node on it gains ``weight``, except the first ``known``, already added as part of
        this same span (so a span can be inserted while it grows)."""
        node, added = self.root, weight * self._scale
        for depth, token in enumerate(span):
            child = node[1].get(token)
            if child is None:
                child = node[1][token] = _new_node()
                self.num_nodes += 1
            if depth >= known:
                child[0] += added
            node = child
        if self.num_nodes > self.max_nodes:
            self._shrink()

    def insert_windows(self, tokens: Sequence[int], known: int = 0, weight: float = 1.0) -> None:
        """Insert the span of up to ``window`` tokens that starts at each position of ``tokens``, given that the
        spans were already inserted when ``tokens`` had only its first ``known`` entries."""
        for start in range(max(0, known - self.window + 1), len(tokens)):
            self.insert(tokens[start:start + self.window], weight, known=max(0, known - start))

    def match(self, context: Sequence[int], max_match: int) -> Iterator[tuple[int, Node]]:
        """The nodes reached by the last ``j`` tokens of ``context`` that have continuations, longest ``j`` first."""
        for length in range(min(max_match, len(context), self.window - 1), 0, -1):
            node: Node | None = self.root
            for token in context[len(context) - length:]:
                node = node[1].get(token)
                if node is None:
                    break
            if node is not None and node[1]:
                yield length, node

    def _rescale(self, factor: float) -> None:
        stack = [self.root]
        while stack:
            node = stack.pop()
            node[0] *= factor
            stack.extend(node[1].values())

    def _shrink(self) -> None:
        """Drop the lightest nodes (with their subtrees) until the trie holds at most 90% of ``max_nodes``."""
        target = int(self.max_nodes * 0.9)
        weights = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node[1].values():
                weights.append(child[0])
                stack.append(child)
        weights.sort()
        threshold = weights[len(weights) - target - 1]  # keep the `target` heaviest (fewer on ties)
        self.num_nodes = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            kept = {token: child for token, child in node[1].items() if child[0] > threshold}
            node[1] = kept
            self.num_nodes += len(kept)
            stack.extend(kept.values())
