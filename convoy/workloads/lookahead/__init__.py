"""Lossless lookahead decoding: multi-branch drafts from a token trie, verified in one forward pass."""

from __future__ import annotations

from convoy.workloads.lookahead.draft import DraftTree, build_draft
from convoy.workloads.lookahead.errors import DecodingError
from convoy.workloads.lookahead.trie import TokenTrie

__all__ = ["DecodingError", "DraftTree", "LookaheadGenerator", "TokenTrie", "build_draft"]


def __getattr__(name: str):  # the generator imports torch; the trie and drafts do not
    if name == "LookaheadGenerator":
        from convoy.workloads.lookahead.generator import LookaheadGenerator

        return LookaheadGenerator
    raise AttributeError(name)
