"""Draft trees: the candidate continuations one verification pass checks, taken best first from token tries.

Pure Python. A tree hangs below the *root*, the newest token (known, not yet in the KV cache); node ``i`` holds
``tokens[i]`` and its parent is ``parents[i]`` (``-1`` for the root). Nodes are in depth-first order with the best
branch first, so when the best branch is accepted the accepted entries are already contiguous.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from convoy.workloads.lookahead.trie import TokenTrie


@dataclass
class DraftTree:
    """Candidate tokens as a tree; ``ranks[i]`` is the order in which node ``i`` was chosen (0 = best);
    ``match_length`` is how many context tokens the best source matched (0: no match, no draft)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    match_length: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node (1 for a child of the root)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def ancestors(self, node: int) -> list[int]:
        """Node indices from ``node`` up to (not including) the root."""
        chain = []
        while node >= 0:
            chain.append(node)
            node = self.parents[node]
        return chain

    def truncate(self, size: int) -> DraftTree:
        """The best ``size`` nodes (a subtree, since a parent is always chosen before its children)."""
        if size >= len(self):
            return self
        keep = [i for i in range(len(self)) if self.ranks[i] < size]
        index = {old: new for new, old in enumerate(keep)}
        return DraftTree([self.tokens[i] for i in keep], [index.get(self.parents[i], -1) for i in keep],
                         [self.ranks[i] for i in keep], self.match_length if keep else 0)

    def children_by_token(self) -> list[dict[int, int]]:
        """For the root (entry 0) and each node (entry i + 1): child token -> child index."""
        children: list[dict[int, int]] = [{} for _ in range(len(self) + 1)]
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            children[parent + 1].setdefault(token, node)
        return children

    def accepted(self, truth: Sequence[int]) -> list[int]:
        """Indices of the nodes along ``truth`` (the tokens that really follow the root), as far as they match."""
        children, path, parent = self.children_by_token(), [], -1
        for token in truth:
            node = children[parent + 1].get(token)
            if node is None:
                break
            path.append(node)
            parent = node
        return path


def build_draft(tries: Sequence[TokenTrie], context: Sequence[int], size: int, branch_length: int,
                max_match: int) -> DraftTree:
    """Up to ``size`` draft tokens continuing ``context``, at most ``branch_length`` deep.

    Matches are taken longest first (and, for equal lengths, in the order of ``tries``); inside one match, paths by
    their frequency relative to the matched context. Continuations of several matches that share a prefix merge
    into one branch.
    """
    if size <= 0 or branch_length <= 0 or not context:
        return DraftTree()
    matches = [(length, order, node) for order, trie in enumerate(tries)
               for length, node in trie.match(context, max_match)]
    matches.sort(key=lambda match: (-match[0], match[1]))
    heap: list[tuple[int, float, int, int, int, list]] = []
    counter = 0
    for cls, (_, _, node) in enumerate(matches):
        for token, child in node[1].items():
            heap.append((cls, -child[0] / node[0], counter, -1, token, child))
            counter += 1
    heapq.heapify(heap)
    tokens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    while heap and len(tokens) < size:
        cls, score, _, parent, token, trie_node = heapq.heappop(heap)
        node = index.get((parent, token))
        if node is None:
            node = index[(parent, token)] = len(tokens)
            tokens.append(token)
            parents.append(parent)
            depth.append(1 if parent < 0 else depth[parent] + 1)
        if depth[node] >= branch_length:
            continue
        base = trie_node[0] / -score  # the matched node's weight, so children score relative to the match
        for child_token, child in trie_node[1].items():
            heapq.heappush(heap, (cls, -child[0] / base, counter, node, child_token, child))
            counter += 1
    tree = _depth_first(tokens, parents)
    tree.match_length = matches[0][0] if tokens else 0
    return tree


def _depth_first(tokens: list[int], parents: list[int]) -> DraftTree:
    """Reorder nodes chosen best first (``ranks`` = that order) into depth-first order, best child first."""
    children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)  # already best first
    tree, index = DraftTree(), {}
    stack = list(reversed(children[0]))
    while stack:
        node = stack.pop()
        index[node] = len(tree.tokens)
        tree.tokens.append(tokens[node])
        tree.parents.append(index[parents[node]] if parents[node] >= 0 else -1)
        tree.ranks.append(node)
        stack.extend(reversed(children[node + 1]))
    return tree
