"""Lookahead decoding, the pure parts: the token trie, draft trees taken from it, and the adaptive draft size."""

from __future__ import annotations

import random

import pytest

from convoy.workloads.lookahead.adaptive import DraftSizer
from convoy.workloads.lookahead.draft import DraftTree, build_draft
from convoy.workloads.lookahead.trie import TokenTrie


def _paths(trie: TokenTrie) -> dict[tuple[int, ...], float]:
    found, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node[1].items():
            found[path + (token,)] = child[0]
            stack.append((path + (token,), child))
    return found


def test_windows_inserted_while_a_sequence_grows_equal_one_insertion_of_the_whole() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(5) for _ in range(60)]
    whole, grown = TokenTrie(window=6), TokenTrie(window=6)
    whole.insert_windows(tokens)
    known = 0
    while known < len(tokens):
        upto = min(len(tokens), known + rng.randrange(1, 5))
        grown.insert_windows(tokens[:upto], known=known)
        known = upto
    assert _paths(grown) == _paths(whole)
    assert grown.num_nodes == whole.num_nodes == len(_paths(whole))


def test_a_child_never_outweighs_its_parent_and_counts_are_frequencies() -> None:
    trie = TokenTrie(window=3)
    trie.insert_windows([1, 2, 3, 1, 2, 4, 1, 2, 3])
    paths = _paths(trie)
    assert paths[(1, 2)] == 3 and paths[(1, 2, 3)] == 2 and paths[(1, 2, 4)] == 1
    for path, weight in paths.items():
        if len(path) > 1:
            assert weight <= paths[path[:-1]]


def test_match_is_longest_suffix_first_and_skips_nodes_without_continuations() -> None:
    trie = TokenTrie(window=5)
    trie.insert_windows([7, 1, 2, 3, 9, 9, 2, 3, 5])
    lengths = [length for length, _ in trie.match([0, 1, 2, 3], max_match=4)]
    assert lengths == [3, 2, 1]  # [1,2,3] and [2,3] and [3] continue; the 4-token suffix never occurred
    length, node = next(iter(trie.match([0, 1, 2, 3], max_match=4)))
    assert sorted(node[1]) == [9]


def test_decay_makes_old_insertions_count_less_and_the_cap_prunes_the_lightest() -> None:
    trie = TokenTrie(window=2, decay=0.5)
    trie.insert([1, 2])
    trie.new_epoch()
    trie.insert([1, 3])
    children = trie.root[1][1][1]
    assert children[3][0] == 2 * children[2][0]
    capped = TokenTrie(window=3, max_nodes=10)
    for _ in range(5):
        capped.insert([1, 2, 3])  # heavy path
    for token in range(20, 40):
        capped.insert([token])  # light singletons
    assert capped.num_nodes <= 10 and len(_paths(capped)) == capped.num_nodes
    assert (1, 2, 3) in _paths(capped)


def test_bad_trie_settings_are_refused() -> None:
    for kwargs in ({"window": 1}, {"window": 4, "max_nodes": 0}, {"window": 4, "decay": 0.0}):
        with pytest.raises(ValueError):
            TokenTrie(**kwargs)


def test_draft_prefers_the_longest_match_then_frequency_and_respects_the_limits() -> None:
    trie = TokenTrie(window=6)
    trie.insert_windows([5, 1, 2, 3, 4] + [9, 1, 2, 8, 8] * 3)  # after [1, 2]: 8 (x3) beats 3 (x1)
    tree = build_draft([trie], [5, 1, 2], size=8, branch_length=3, max_match=3)
    assert tree.tokens[:3] == [3, 4, 9]  # the 3-token match [5, 1, 2] comes first, laid out as one branch
    assert tree.parents[:3] == [-1, 0, 1]
    assert max(tree.depths()) <= 3 and len(tree) <= 8
    assert 8 in [tree.tokens[i] for i in range(len(tree)) if tree.parents[i] == -1]  # the shorter match fills in
    short = build_draft([trie], [1, 2], size=8, branch_length=3, max_match=3)
    assert short.tokens[0] == 8  # most frequent first
    assert build_draft([trie], [1, 2], size=0, branch_length=3, max_match=3).tokens == []
    assert build_draft([trie], [], size=8, branch_length=3, max_match=3).tokens == []


def test_truncation_keeps_the_best_nodes_as_a_subtree_and_acceptance_follows_the_truth() -> None:
    rng = random.Random(0)
    trie = TokenTrie(window=8)
    trie.insert_windows([rng.randrange(6) for _ in range(300)])
    tree = build_draft([trie], [1, 2], size=30, branch_length=6, max_match=3)
    assert len(tree) == 30
    for size in (1, 5, 17):
        small = tree.truncate(size)
        assert len(small) == size and sorted(small.ranks) == list(range(size))
        for node, parent in enumerate(small.parents):
            assert parent < node  # parents come first (depth-first order)
    path = tree.accepted([tree.tokens[0], tree.tokens[1], -1]) if tree.parents[1] == 0 else []
    if path:
        assert path == [0, 1]
    assert DraftTree([4, 5, 6], [-1, 0, -1], [0, 1, 2]).accepted([4, 5, 7]) == [0, 1]
    assert DraftTree([4, 5, 6], [-1, 0, -1], [0, 1, 2]).accepted([6, 5]) == [2]


def test_sizer_drafts_only_when_hindsight_says_it_pays() -> None:
    sizer = DraftSizer(max_size=16)
    assert sizer.choose([4]) == 0  # nothing timed yet
    sizer.record_time(0, 0.010)
    weak = DraftTree([1, 2, 3, 4], [-1, 0, 1, 2], [0, 1, 2, 3], match_length=1)
    for position in range(0, 40, 5):  # drafts from 1-token matches that the text never follows
        sizer.propose(0, position, weak)
    sizer.observe(0, [9] * 40)
    assert sizer.choose([1]) == 0 and not sizer.pending
    strong = DraftTree([1, 2, 3, 4], [-1, 0, 1, 2], [0, 1, 2, 3], match_length=4)
    sizer.propose(0, 40, strong)
    sizer.observe(0, [9] * 40 + [1, 2])
    assert sizer.pending  # all known tokens were drafted so far: wait for the rest
    sizer.observe(0, [9] * 40 + [1, 2, 3, 4, 0])
    assert not sizer.pending
    assert sizer.choose([4]) >= 4 and sizer.choose([1]) == 0  # what a 4-token match drafts is copied text
    assert sizer.choose([0, 4, 0]) >= 4
    chosen = sizer.choose([4])
    sizer.record_time(chosen, 0.100)  # a dear size is dropped, and larger untimed ones count as at least as dear
    assert sizer.choose([4]) < chosen
    for size in sizer.sizes[1:]:  # drafted passes 10x dearer than plain ones: back to plain decoding
        sizer.record_time(size, 0.100)
    assert sizer.choose([4]) == 0
    sizer.reset()
    assert not sizer.gain and not sizer.pending
