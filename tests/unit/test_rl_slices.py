"""State-space slices: a declared cut must tile the seeds, and every deal to a changing set of actors owns each
slice exactly once, moving as few slices as it can."""

from __future__ import annotations

import random

import pytest

from convoy.errors import ConfigError
from convoy.workloads.rl.slices import Slice, SliceBook, check_cover, check_dealt, deal, seed_slices


def test_seed_slices_tile_the_seeds_evenly() -> None:
    slices = seed_slices(10, 4)
    assert [(s.start, s.stop) for s in slices] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    check_cover(slices, 10)
    assert [slices[1].seed(e) for e in range(4)] == [2, 3, 4, 2]
    with pytest.raises(ConfigError, match="cannot cut 3 seeds into 4 slices"):
        seed_slices(3, 4)


@pytest.mark.parametrize(("slices", "error"), [
    ([], "declared no slices"),
    ([Slice(0, 0, 5), Slice(1, 4, 10)], r"slice 1 \[4, 10\) overlaps the seeds before 5"),
    ([Slice(0, 0, 5), Slice(1, 6, 10)], r"seeds \[5, 6\) are in no slice"),
    ([Slice(0, 0, 5), Slice(1, 5, 8)], r"seeds \[8, 10\) are in no slice"),
    ([Slice(0, 0, 5), Slice(1, 5, 12)], "reach seed 12, past the space's 10"),
    ([Slice(0, 0, 5), Slice(2, 5, 10)], "numbered 0..1"),
    ([Slice(0, 0, 0), Slice(1, 0, 10)], r"slice 0 \[0, 0\) is empty"),
])
def test_a_cut_that_does_not_tile_the_space_is_named(slices: list[Slice], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        check_cover(slices, 10)


def test_a_deal_is_even_and_keeps_what_each_actor_had() -> None:
    first = deal(range(8), ["a", "b"], {})
    check_dealt(first, range(8))
    assert sorted(len(v) for v in first.values()) == [4, 4]
    grown = deal(range(8), ["a", "b", "c"], first)
    check_dealt(grown, range(8))
    assert sorted(len(v) for v in grown.values()) == [2, 3, 3]
    assert set(grown["a"]) <= set(first["a"]) and set(grown["b"]) <= set(first["b"])  # only c's share moved
    shrunk = deal(range(8), ["b", "c"], grown)
    check_dealt(shrunk, range(8))
    assert set(grown["b"]) <= set(shrunk["b"]) and set(grown["c"]) <= set(shrunk["c"])


def test_every_deal_over_random_comings_and_goings_owns_each_slice_once() -> None:
    rng = random.Random(7)
    book = SliceBook(seed_slices(100, 13))
    actors: list[str] = []
    next_id = 0
    for _ in range(500):
        if actors and (len(actors) > 12 or rng.random() < 0.4):
            actors.remove(rng.choice(actors))
        else:
            actors.append(f"actor{next_id}")
            next_id += 1
        dealt = book.redeal(actors)  # checks the invariant itself
        assert set(dealt) == set(actors)
        if actors:
            sizes = [len(v) for v in dealt.values()]
            assert max(sizes) - min(sizes) <= 1
    assert book.deals == 500 and book.moved > 0


def test_a_broken_deal_is_named() -> None:
    with pytest.raises(AssertionError, match=r"unowned \[2\], owned twice \{1: \['a', 'b'\]\}"):
        check_dealt({"a": (0, 1), "b": (1,)}, range(3))


def test_visits_are_counted_per_slice() -> None:
    book = SliceBook(seed_slices(10, 2))
    book.visited({0: 3, 1: 1})
    book.visited({0: 2, 5: 9})
    assert book.visits == {0: 5, 1: 1}
